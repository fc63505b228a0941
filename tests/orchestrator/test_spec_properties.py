"""Property-based specs (hypothesis), generated from the spec schema: any value at any field
(or at a key the schema lacks) of any section either validates or is refused with one line that
names a field of the spec; nothing else escapes ``parse_spec``."""

import copy
import string
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.planning.spec import ExperimentSpec, SpecError, Variant, parse_spec
from workloads.core.config import (
    MOVED,
    BudgetConfig,
    EngineConfig,
    OptimizerConfig,
    ResourcesConfig,
    ScheduleConfig,
    TrainingConfig,
)
from workloads.lm.data.corpus import CorpusConfig

DEMO = yaml.safe_load((Path(__file__).resolve().parents[2] / "experiments" / "demo-grid.yaml")
                      .read_text())
TOP = sorted(set(ExperimentSpec.model_fields) - {"workload_config"} | {"data"})
SECTIONS = {(): TOP, ("budget",): sorted(BudgetConfig.model_fields),
            ("training",): sorted(TrainingConfig.model_fields),
            ("optimizer",): sorted(OptimizerConfig.model_fields),
            ("schedule",): sorted(ScheduleConfig.model_fields),
            ("engine",): sorted(EngineConfig.model_fields),
            ("resources",): sorted(ResourcesConfig.model_fields),
            ("data",): sorted(CorpusConfig.model_fields),
            ("variants", "cem"): sorted(Variant.model_fields)}

scalars = (st.none() | st.booleans() | st.integers(-10**12, 10**12)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(string.ascii_lowercase, max_size=6), inner,
                                        max_size=3), max_leaves=6)


@st.composite
def mutated_demo(draw) -> tuple[dict, tuple[str, ...]]:
    """The demo spec with one field (a schema field, or a new key) set to any YAML value."""
    data = copy.deepcopy(DEMO)
    section = draw(st.sampled_from(sorted(SECTIONS)))
    key = draw(st.sampled_from(SECTIONS[section])
               | st.text(string.ascii_lowercase + "_", min_size=1, max_size=10))
    target = data
    for part in section:
        target = target.setdefault(part, {})
    target[key] = draw(values)
    return data, (*section, key)


@given(mutated_demo())
@settings(max_examples=400, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
def test_any_value_at_any_field_validates_or_is_one_line_naming_a_field(case):
    data, path = case
    try:
        spec = parse_spec(data, "spec.yaml")
    except SpecError as e:
        message = str(e)
        assert "\n" not in message and message.startswith("spec.yaml: "), message
        if path[:-1] == ("training",) and path[-1] in MOVED:  # a key that moved: its place
            assert message == f"spec.yaml: training.{path[-1]}: moved to {MOVED[path[-1]]}"
        elif path[-1] not in SECTIONS[path[:-1]]:  # a key the schema lacks is named as such
            assert message == f"spec.yaml: {'.'.join(path)}: unknown key", message
        else:  # a schema field: the error names a field of the spec
            field = message.removeprefix("spec.yaml: ").split(": ")[0]
            assert field.split(".")[0] in TOP, message
    else:
        assert isinstance(spec, ExperimentSpec)
        assert parse_spec(spec.model_dump(), "again") == spec  # what validates, round-trips
