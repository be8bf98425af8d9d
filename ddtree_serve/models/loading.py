"""HF-style model directories: `config.json`, `*.safetensors` (tokenizers: `tokenizer.py`).

Real checkpoints (a local Qwen3 or DeepseekV3/Kimi K2 target + z-lab DFlash drafter) and the
bundled pair go through the same functions; the target's family comes from `families.py`.
Models are built on the meta device and the loaded tensors are assigned in place, so a
checkpoint is held in memory once, already in the requested dtype and device.
"""

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from ddtree_serve.models.dflash import DFlashConfig, DFlashDraftModel
from ddtree_serve.models.families import TargetModel, target_family
from ddtree_serve.models.parallel import TensorParallel, TensorSlice, shard_target_model

_BUNDLED_DIR = Path(__file__).resolve().parent.parent / "bundled"
_EMBED_KEY = "model.embed_tokens.weight"
_HEAD_KEY = "lm_head.weight"


def bundled_target_dir() -> Path:
    """Directory of the project's bundled target model (`ddtree_serve/bundled/target`)."""
    return _BUNDLED_DIR / "target"


def bundled_drafter_dir() -> Path:
    """Directory of the project's bundled DFlash drafter (`ddtree_serve/bundled/drafter`)."""
    return _BUNDLED_DIR / "drafter"


def read_config(path: str | Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def read_eos_token_ids(path: str | Path) -> tuple[int, ...]:
    """End-of-sequence ids from `config.json` and, when present, `generation_config.json`."""
    path = Path(path)
    found: list[int] = []
    for name in ("config.json", "generation_config.json"):
        file = path / name
        eos = json.loads(file.read_text()).get("eos_token_id") if file.exists() else None
        for token_id in eos if isinstance(eos, list) else [] if eos is None else [eos]:
            if int(token_id) not in found:
                found.append(int(token_id))
    return tuple(found)


def _safetensors_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    return files


def load_tensors(
    path: str | Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    keys: set[str] | None = None,
    dtype_for_key: Callable[[str], torch.dtype | None] | None = None,
    shard_of_key: Callable[[str], tuple[str, TensorSlice | None] | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Read every tensor (or only `keys`) of a directory's safetensors shards, cast to `dtype`.

    `dtype_for_key` overrides the dtype per key (None skips the key without reading it).
    `shard_of_key` (a tensor-parallel rank's `ShardPlan`) names the part of each key to read:
    (key to store it under, slice or None for the whole tensor), or None to skip the key; a
    slice is read with `get_slice`, so the rest of the tensor never leaves the file.
    """
    tensors: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(Path(path)):
        with safe_open(str(file), framework="pt", device=str(device)) as shard:
            for key in shard.keys():  # noqa: SIM118 (safe_open handles are not iterable)
                if keys is not None and key not in keys:
                    continue
                key_dtype = dtype if dtype_for_key is None else dtype_for_key(key)
                part = (key, None) if shard_of_key is None else shard_of_key(key)
                if key_dtype is None or part is None:
                    continue
                local_key, tensor_slice = part
                if tensor_slice is None:
                    tensors[local_key] = shard.get_tensor(key).to(key_dtype)
                else:
                    wanted = slice(tensor_slice.start, tensor_slice.stop)
                    index = (slice(None),) * tensor_slice.dim + (wanted,)
                    tensors[local_key] = shard.get_slice(key)[index].to(key_dtype)
    return tensors


def _assign_weights(module: nn.Module, tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Assign `tensors` to a meta-device module; every parameter must be covered, exactly."""
    # old Llama checkpoints store RoPE frequencies, which the model recomputes
    tensors = {k: t for k, t in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    expected = set(module.state_dict().keys())
    missing, unexpected = expected - tensors.keys(), tensors.keys() - expected
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not match the model: missing {sorted(missing)[:8]}, "
            f"unexpected {sorted(unexpected)[:8]}"
        )
    module.load_state_dict(tensors, strict=True, assign=True)


def load_target_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tensor_parallel: TensorParallel | None = None,
) -> TargetModel:
    """Load a causal LM directory of any registered family (Qwen3/Qwen2/Llama, DeepseekV3) in eval mode.

    With a `tensor_parallel` group of more than one rank, only this rank's shard is built and
    read (`parallel.shard_target_model`).
    """
    path = Path(path)
    raw_config = read_config(path)
    family = target_family(raw_config)
    config = family.parse_config(raw_config)
    with torch.device("meta"):
        model = family.build_model(config)
    shard_of_key = None
    if tensor_parallel is not None and tensor_parallel.world_size > 1:
        plan = shard_target_model(model, tensor_parallel)
        shard_of_key = plan.with_prefix(family.checkpoint_prefix(config))
    tensors = load_tensors(
        path,
        dtype=dtype,
        device=device,
        dtype_for_key=lambda key: family.tensor_dtype(config, key, dtype),
        shard_of_key=shard_of_key,
    )
    tensors = family.prepare_tensors(config, tensors)
    if config.tie_word_embeddings:
        tensors[_HEAD_KEY] = tensors[_EMBED_KEY]
    _assign_weights(model, tensors, path)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_draft_model(
    path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> DFlashDraftModel:
    """Load a DFlash drafter directory (its own weights only) in eval mode."""
    path = Path(path)
    config = DFlashConfig.from_dict(read_config(path))
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    _assign_weights(model, load_tensors(path, dtype=dtype, device=device), path)
    return model.eval()


def load_embedding_and_head(
    target_path: str | Path, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the target's token embedding `[V, H]` and LM head `[V, H]`, for the drafter to borrow."""
    target_path = Path(target_path)
    raw_config = read_config(target_path)
    family = target_family(raw_config)
    config = family.parse_config(raw_config)
    prefix = family.checkpoint_prefix(config)
    embed_key, head_key = prefix + _EMBED_KEY, prefix + _HEAD_KEY
    tensors = load_tensors(target_path, dtype=dtype, device=device, keys={embed_key, head_key})
    embed = tensors[embed_key]
    head = embed if config.tie_word_embeddings else tensors[head_key]
    return embed, head


def save_model_dir(
    module: nn.Module, config: dict, path: str | Path, *, dtype: torch.dtype | None = None
) -> Path:
    """Write `config.json` and `model.safetensors` (optionally cast) into `path`; returns it.

    Tied weights are written once, under their first name (HF's convention for tied heads).
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    seen_storage: set[int] = set()
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in module.state_dict().items():
        if tensor.data_ptr() in seen_storage:
            continue
        seen_storage.add(tensor.data_ptr())
        tensors[name] = (tensor.to(dtype) if dtype is not None else tensor).detach().contiguous().cpu()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return path
