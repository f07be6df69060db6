"""Model families for ``mmtrain``, looked up by name through a registry.

    from mmcache.train.models import build_model, get_model_family
    model = build_model("dit", "tiny", in_channels=16, text_dim=512)   # sizes from the store schema
    family = get_model_family("dit")
    terms = family.training_loss(model, batch, generators, family.resolve_objective(cfg.objective))

See ``registry.py`` for the contract a family fulfils. Importing this package registers every
built-in family (importing ``dit`` / ``vlm`` runs its ``@register_model``).
"""

from .registry import (
    InputShapeError,
    ModelConfigError,
    ModelFamily,
    build_model,
    count_parameters,
    export_model,
    get_model_family,
    model_names,
    register_model,
)
from ..objective import LossTerms
from . import dit  # noqa: E402,F401  (registers "dit")
from .dit import DiT, DiTConfig
from .dit_data import LatentTextBatch, pad_text
from . import vlm  # noqa: E402,F401  (registers "vlm")
from .vlm import VLM, VLMConfig

__all__ = [
    "DiT",
    "DiTConfig",
    "VLM",
    "VLMConfig",
    "InputShapeError",
    "LatentTextBatch",
    "LossTerms",
    "ModelConfigError",
    "ModelFamily",
    "build_model",
    "count_parameters",
    "export_model",
    "get_model_family",
    "model_names",
    "pad_text",
    "register_model",
]
