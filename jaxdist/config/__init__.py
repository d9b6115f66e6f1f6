"""Configuration: the whole job's config, its sections, reading it and checking it.  No JAX.

A config is built from defaults, then a TOML file, then dotted command-line overrides
(:func:`load_config`); it is a frozen dataclass per TOML table, every field with its help text, and
:meth:`Config.replace` derives one in code (dotted keys, checked like overrides).  The modules, in the
order they build on one another (none imports a later one):

* :mod:`~jaxdist.config.fields`: the choices a field offers (``Literal`` types), the help-text field,
  the checkpoint tags;
* :mod:`~jaxdist.config.ranges`: the numeric ranges every field must lie in;
* :mod:`~jaxdist.config.model`, :mod:`~jaxdist.config.mesh`, :mod:`~jaxdist.config.run`,
  :mod:`~jaxdist.config.controller`: the sections, each checking itself;
* :mod:`~jaxdist.config.values`: dotted keys, values converted to their field's type, presets;
* :mod:`~jaxdist.config.schema`: :class:`Config` and the rules that join sections (:func:`validate`);
* :mod:`~jaxdist.config.hf_dir`, :mod:`~jaxdist.config.hf`: a Hugging Face directory's tokenizer and
  ``config.json``;
* :mod:`~jaxdist.config.load`: reading (:func:`load_config`, :func:`from_dict`) and the reference.

Import from here; the CLI reads a config before JAX starts.
"""

from jaxdist.config.controller import CONTROLLER_LAUNCHERS, CONTROLLER_RECOVERY, ControllerConfig
from jaxdist.config.fields import (
    CHECKPOINT_NAMES,
    PIPELINE_SCHEDULES,
    Attention,
    ChunkSplit,
    CrashedRank,
    DataSource,
    Dispatch,
    DType,
    GradSync,
    Launcher,
    PipelineSchedule,
    Recovery,
    RopeScaling,
    Router,
    TokenDType,
    Tracker,
    choices,
    is_loopback,
)
from jaxdist.config.load import from_dict, load_config, reference_markdown
from jaxdist.config.mesh import JAX_POLICIES, MESH_AXES, MeshConfig, Remat
from jaxdist.config.model import MODEL_PRESETS, ModelConfig, MoEConfig
from jaxdist.config.run import CheckpointConfig, DataConfig, PipelineConfig, TrainConfig
from jaxdist.config.schema import (
    MOE_CAPACITY_CHUNKS,
    SECTIONS,
    Config,
    check_ordered,
    unused_devices_note,
    validate,
    validate_devices,
    validate_model_on_mesh,
)
from jaxdist.config.values import MOVED_KEYS, SECTION_CLASSES, all_keys, apply_preset, parse_overrides
from jaxdist.errors import ConfigError

__all__ = [
    "CHECKPOINT_NAMES",
    "CONTROLLER_LAUNCHERS",
    "CONTROLLER_RECOVERY",
    "JAX_POLICIES",
    "MESH_AXES",
    "MODEL_PRESETS",
    "MOE_CAPACITY_CHUNKS",
    "MOVED_KEYS",
    "PIPELINE_SCHEDULES",
    "SECTIONS",
    "SECTION_CLASSES",
    "Attention",
    "CheckpointConfig",
    "ChunkSplit",
    "Config",
    "ConfigError",
    "ControllerConfig",
    "CrashedRank",
    "DType",
    "DataConfig",
    "DataSource",
    "Dispatch",
    "GradSync",
    "Launcher",
    "MeshConfig",
    "ModelConfig",
    "MoEConfig",
    "PipelineConfig",
    "PipelineSchedule",
    "Recovery",
    "Remat",
    "RopeScaling",
    "Router",
    "TokenDType",
    "Tracker",
    "TrainConfig",
    "all_keys",
    "apply_preset",
    "check_ordered",
    "choices",
    "from_dict",
    "is_loopback",
    "load_config",
    "parse_overrides",
    "reference_markdown",
    "unused_devices_note",
    "validate",
    "validate_devices",
    "validate_model_on_mesh",
]
