"""The ``vlm`` family: an InternVL / LLaVA-style vision-language model over cached ViT features.

Plain ``nn.Module``s, no distributed code: a projector (optional pixel shuffle, MLP) turns cached
ViT features into image tokens spliced into packed rows (``train.data.packing``) of the decoder
(``train.models.llm``); ``model.args.train`` picks the parts that train; ``next_token_loss``
follows the registry's loss contract. Design: docs/design/train.md, "The VLM family".
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..live.record import EXPORT_RECORD  # marks a trained encoder's folder
from .hf import decoder_config_from_hf, load_hf_weights, read_hf_config, save_hf
from .llm import Decoder, DecoderConfig
from .registry import InputShapeError, ModelConfigError, register_model
from .vlm_data import PackedVLMData
from ..objective import LossTerms
from ..data.packing import IGNORE, PackedBatch

PARTS = ("projector", "llm")


@dataclasses.dataclass(frozen=True, kw_only=True)
class VLMConfig:
    llm_path: str | None = None  # a Hugging Face Llama / Qwen2 folder; its config.json overrides the dims below
    dim: int = 64
    depth: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None
    mlp_dim: int = 128
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    pixel_shuffle: bool = True  # 2x2 pixel shuffle before the projector MLP (InternVL); False: LLaVA
    projector_norm_eps: float = 1e-5
    train: tuple[str, ...] = PARTS  # parts that train: ("projector",) = stage 1, both = stage 2

    def __post_init__(self) -> None:
        unknown = sorted(set(self.train) - set(PARTS))
        if unknown or not self.train:
            raise ModelConfigError(f"model.args.train must list some of {list(PARTS)}, got {list(self.train)}")

    def decoder_config(self, vocab_size: int) -> DecoderConfig:
        """The LLM's architecture: from ``llm_path`` when given, else these dims, sized to the
        store's vocabulary."""
        if self.llm_path is not None:
            config = decoder_config_from_hf(self.llm_path)
            if config.vocab_size < vocab_size:
                raise ModelConfigError(
                    f"the LLM at {self.llm_path} has {config.vocab_size} token embeddings, but the store's tokenizer has "
                    f"{vocab_size} tokens; encode with that LLM's tokenizer"
                )
            return config
        return DecoderConfig(
            vocab_size=vocab_size, dim=self.dim, depth=self.depth, heads=self.heads, kv_heads=self.kv_heads,
            head_dim=self.head_dim, mlp_dim=self.mlp_dim, rope_theta=self.rope_theta, norm_eps=self.norm_eps,
            tie_embeddings=self.tie_embeddings, qkv_bias=self.qkv_bias,
        )

    def image_tokens(self, vit_shape: tuple[int, ...]) -> int:
        """LLM positions for one image of stored shape [P, D] or [T, P, D]."""
        tiles, patches = (1, vit_shape[0]) if len(vit_shape) == 2 else vit_shape[:2]
        return tiles * (patches // 4 if self.pixel_shuffle else patches)


# Real-scale presets (meta-device only on CPU; ``mmtrain fit --dry-run`` counts them). Both start
# from a Hugging Face folder in practice (``--set model.args.llm_path=...``); the dims here are
# those of that LLM, for random init and for sizing.
VLM_PRESETS: dict[str, VLMConfig] = {
    "tiny": VLMConfig(dim=64, depth=2, heads=4, kv_heads=2, mlp_dim=128),
    # InternVL2-2B: InternViT-300M (1024 wide, 448^2 tiles of 32x32 patches -> 256 tokens per tile
    # after the pixel shuffle) -> InternLM2-1.8B-class LLM (2048 wide, 24 layers, 16 heads, 8 KV).
    "internvl2-2b": VLMConfig(dim=2048, depth=24, heads=16, kv_heads=8, mlp_dim=8192, rope_theta=1_000_000.0,
                              norm_eps=1e-5, pixel_shuffle=True),
    # LLaVA-1.5-7B: CLIP ViT-L/14-336 penultimate layer (1024 wide, 576 tokens) -> Vicuna-7B
    # (Llama-2-7B dims: 4096 wide, 32 layers, 32 heads, no GQA).
    "llava-1.5-7b": VLMConfig(dim=4096, depth=32, heads=32, kv_heads=32, mlp_dim=11008, norm_eps=1e-5, pixel_shuffle=False),
}


def pixel_shuffle(features: torch.Tensor) -> torch.Tensor:
    """[T, g*g, D] -> [T, (g/2)^2, 4D]: each 2x2 patch neighbourhood becomes one token."""
    tiles, patches, width = features.shape
    side = math.isqrt(patches)
    if side * side != patches or side % 2:
        raise InputShapeError(
            f"the 2x2 pixel shuffle needs a square grid of even side, got {patches} patches per tile; "
            "set model.args.pixel_shuffle=false or encode with an even tile grid"
        )
    x = features.reshape(tiles, side // 2, 2, side // 2, 2, width).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(tiles, (side // 2) ** 2, 4 * width)


class Projector(nn.Module):
    """ViT states -> LLM-width image tokens (InternVL's ``mlp1`` / LLaVA's ``mm_projector``)."""

    def __init__(self, vit_dim: int, llm_dim: int, *, shuffle: bool, eps: float) -> None:
        super().__init__()
        self.vit_dim, self.shuffle = vit_dim, shuffle
        width = vit_dim * 4 if shuffle else vit_dim  # the 2x2 shuffle stacks 4 patches' states
        self.norm = nn.LayerNorm(width, eps=eps)
        self.fc1 = nn.Linear(width, llm_dim)
        self.fc2 = nn.Linear(llm_dim, llm_dim)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """[T, P, D] -> [T * P', llm_dim]."""
        x = pixel_shuffle(features) if self.shuffle else features
        return self.fc2(F.gelu(self.fc1(self.norm(x)))).reshape(-1, self.fc2.out_features)


def next_token_loss(model: nn.Module, batch: PackedBatch, generators, objective) -> LossTerms:
    """The ``vlm`` family's ``training_loss``: summed cross-entropy over label positions."""
    logits = model(batch)
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE, reduction="sum")
    return LossTerms(loss_sum=loss, count=batch.num_label_tokens, num_tokens=int((batch.document_ids >= 0).sum()))


@dataclasses.dataclass(frozen=True, kw_only=True)
class NextTokenConfig:
    """The ``vlm`` objective: plain next-token cross-entropy (no settings yet)."""


PROJECTOR_FORMAT = "mmcache-vlm-projector-v1"


def export_vlm(model: VLM, out: Path) -> list[Path]:
    """The ``vlm`` family's export hook: ``out/llm``, a Hugging Face Llama / Qwen2 folder
    (``from_pretrained``-loadable: config.json + model.safetensors), and ``out/projector``, the
    projector's weights (safetensors) with a config.json saying how to rebuild it
    (``load_projector``). Written beside ``out`` first, then moved into place, so a re-run never
    leaves a mix of two exports. ``out`` is shared with the run's trained encoders
    (``mmcache.train.live.joint`` writes ``out/<field>`` with an export record): those are kept, whichever
    of the two exports runs first; anything else in ``out`` is from an earlier export and goes.
    The tokenizer is the one the store was encoded with (its fingerprint is in run.json): copy
    that folder next to ``llm`` to ship a complete model."""
    from safetensors.torch import save_file

    out = Path(out)
    staging = out.with_name(out.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    save_hf(model.llm, staging / "llm", model_type=_hf_model_type(model.config))
    projector = staging / "projector"
    projector.mkdir(parents=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in model.projector.state_dict().items()},
              str(projector / "model.safetensors"), metadata={"format": "pt"})
    spec = {
        "format": PROJECTOR_FORMAT,
        "architecture": "pixel_shuffle(2x2)? -> LayerNorm -> Linear(fc1) -> GELU -> Linear(fc2)",
        "vit_dim": model.projector.vit_dim,
        "llm_dim": model.projector.fc2.out_features,
        "pixel_shuffle": model.projector.shuffle,
        "norm_eps": model.projector.norm.eps,
    }
    (projector / "config.json").write_text(json.dumps(spec, indent=2))
    if out.is_dir():
        for entry in out.iterdir():
            if entry.is_dir() and (entry / EXPORT_RECORD).is_file() and entry.name not in ("llm", "projector"):
                entry.replace(staging / entry.name)
    shutil.rmtree(out, ignore_errors=True)
    staging.replace(out)
    return [out / "llm", out / "projector"]


def load_projector(path: str | Path) -> Projector:
    """A projector exported by ``export_vlm`` (safetensors only: nothing that runs code)."""
    from safetensors.torch import load_file

    folder = Path(path)
    spec = json.loads((folder / "config.json").read_text())
    if spec.get("format") != PROJECTOR_FORMAT:
        raise ModelConfigError(f"{folder}: not a projector exported by mmtrain (format {spec.get('format')!r})")
    projector = Projector(spec["vit_dim"], spec["llm_dim"], shuffle=spec["pixel_shuffle"], eps=spec["norm_eps"])
    projector.load_state_dict(load_file(str(folder / "model.safetensors")))
    return projector


def _hf_model_type(config: VLMConfig) -> str:
    """Export as the architecture the LLM came from; from scratch: qwen2 with q/k/v biases, else llama."""
    if config.llm_path is not None:
        return read_hf_config(config.llm_path)["model_type"]
    return "qwen2" if config.qkv_bias else "llama"


def _tokens_per_sample(config: VLMConfig, sample_shape: tuple) -> int:
    num_ids, vit_shape = sample_shape
    return num_ids if not vit_shape else num_ids - 1 + config.image_tokens(vit_shape)


@register_model(
    "vlm",
    config_cls=VLMConfig,
    objective_cls=NextTokenConfig,
    training_loss=next_token_loss,
    tokens_per_sample=_tokens_per_sample,
    data=PackedVLMData.for_run,
    presets=VLM_PRESETS,
    export=export_vlm,
)
class VLM(nn.Module):
    sequence_parallel_style = "causal_packed"

    def __init__(self, config: VLMConfig, *, vit_dim: int, vocab_size: int) -> None:
        super().__init__()
        if vit_dim < 1 or vocab_size < 1:
            raise ModelConfigError(f"vit_dim and vocab_size must be >= 1, got {vit_dim} and {vocab_size}")
        self.config = config
        self.llm = Decoder(config.decoder_config(vocab_size))
        self.projector = Projector(vit_dim, self.llm.config.dim, shuffle=config.pixel_shuffle, eps=config.projector_norm_eps)
        if config.llm_path is not None and not self.llm.embed_tokens.weight.is_meta:
            load_hf_weights(self.llm, config.llm_path)
        for name, part in self.parts().items():
            part.requires_grad_(name in config.train)

    def parts(self) -> dict[str, nn.Module]:
        return {"projector": self.projector, "llm": self.llm}

    # The hooks parallelism uses (apply_fsdp shards ``blocks``; USP installs its attention and
    # sharding); they live on the decoder and are forwarded here.
    @property
    def blocks(self) -> nn.ModuleList:
        return self.llm.blocks

    @property
    def attention_heads(self) -> int:
        return self.llm.config.heads

    @property
    def sequence_sharding(self):
        return self.llm.sequence_sharding

    @sequence_sharding.setter
    def sequence_sharding(self, value) -> None:
        self.llm.sequence_sharding = value

    def set_attention_fn(self, attn_fn) -> None:
        self.llm.set_attention_fn(attn_fn)

    def inputs_embeds(self, batch: PackedBatch) -> torch.Tensor:
        """Token embeddings with the projected image features spliced in at ``image_mask``."""
        embeds = self.llm.embed_tokens(batch.input_ids)
        positions = int(batch.image_mask.sum())
        if not batch.images:
            if positions:
                raise InputShapeError(f"{positions} image positions in the batch but no image features")
            # Text-only samples: zero image tokens. The projector still joins the graph (with no
            # rows, adding exactly 0), so its gradients exist, as zeros, on every rank: FSDP
            # reduce-scatters only the parameters that have gradients, and ranks whose batches
            # differ in that would disagree on the collective.
            return embeds + self.projector(self._no_image()).sum()
        dtype = self.projector.fc1.weight.dtype
        tokens = torch.cat([self.projector(f.to(dtype)) for f in batch.images])
        if tokens.shape[0] != positions:
            raise InputShapeError(
                f"the batch has {positions} image positions but its {len(batch.images)} image(s) project to {tokens.shape[0]} "
                "tokens; pack with the model's image_tokens (train.data.packing.expand_sample)"
            )
        return embeds.masked_scatter(batch.image_mask[..., None], tokens.to(embeds.dtype))

    def _no_image(self) -> torch.Tensor:
        """An empty feature tensor [0, 4, D_vit] (a 2x2 grid, so the pixel shuffle accepts it)."""
        weight = self.projector.norm.weight  # for the device and dtype
        return weight.new_zeros(0, 4, self.projector.vit_dim)

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """Logits [B, S, vocab] of a packed batch."""
        return self.llm.packed_logits(self.inputs_embeds(batch), batch.position_ids, batch.document_ids)
