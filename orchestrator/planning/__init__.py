"""What a spec asks for, before anything runs: the spec file read and validated
(``spec_yaml``, ``spec``), its grid of trials with their identities (``plan``), which of them
train as one stacked model (``stacks``) and their wall-time estimates (``calibrate``).
Imports nothing else of the orchestrator but its terminal tables."""
