"""The core every other part of CEM Lab builds on, and the only part of ``workloads`` the
orchestrator imports: the ``Trial``, ``Job`` and ``Budget`` that cross to the workers (``trial``),
the ``Workload`` interface (``workload``) and its registry (``registry``), the spec sections
every workload shares (``config``), the ``ModelConfig`` and its presets (``architecture``), the
precision a trial trains in (``precision``), and the plumbing both the orchestrator and the
workers use: local paths (``paths``), the storage root (``storage``), service reachability
(``reach``), atomic writes (``atomic``) and the code fingerprint (``provenance``).
"""
