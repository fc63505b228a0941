"""The language-model workload: its corpus (``data``), the workload itself (``workload``), its
memory estimate, its registered models (``serving``, ``model_card``, ``export``, ``probe``) and
its benchmarks (``step_bench``, ``attention_bench``)."""
