"""LoRA adapters (PEFT checkpoint directories), several per batch.

Every LoRA-capable projection holds, for `max_loras` slots, its adapters stacked along the
rank: A [slots * parts * R, in] and B [out, slots * parts * R], R = max_lora_rank, `parts`
the sub-projections fused into it (q/k/v: 3, gate/up: 2, o and down: 1). Slot s, part p
uses rows/columns [(s * parts + p) * R, ... + r) of both, and B only in the rows of part p's
output; everything else is zero. A step then adds, for every token at once,

    delta = ((x @ A.T) * mask) @ B.T,    mask[t] = 1 on the columns of token t's slot

two thin matmuls whatever the mix of adapters in the batch, with no host reads, so decode
CUDA graphs capture it (the per-token slot ids are one more static input buffer). The
adapter's scale (alpha / r, or alpha / sqrt(r) with rsLoRA) is folded into B when loaded.
Loading writes into the same buffers in place, so captured graphs see new adapters.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.core import admission_rules as rules
from engine.core.admission_rules import InvalidRequestError
from engine.core.params import LoRARequest
from engine.models.loader.safetensors_reader import read_tensors

logger = logging.getLogger(__name__)

# PEFT target name -> (kiln projection inside the layer, which fused part)
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)"
    r"\.lora_([AB])(?:\.default)?\.weight$"
)


@dataclass
class _Loaded:
    request: LoRARequest
    slot: int
    prefix_root: bytes  # prefix-cache namespace: KV computed under this adapter only


class LoRAError(ValueError):
    pass


def adapter_root(path: str | Path) -> bytes:
    """The prefix-cache namespace of an adapter's KV: a hash of its files' bytes, so the same adapter
    shares its KV across reloads and processes (the KV tiers key by it) and any other never does."""
    h = hashlib.blake2b(digest_size=16)
    root = Path(path).expanduser()
    for file in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(str(file.relative_to(root)).encode() + b"\0")
        h.update(file.read_bytes())
    return b"lora:" + h.digest()


def read_adapter(path: str | Path, max_rank: int, num_layers: int) -> dict[tuple[int, str, int], tuple]:
    """{(layer, kiln projection, part): (A [r, in], B [out_part, r] scaled)} from a PEFT directory."""
    path = Path(path).expanduser()
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoRAError(f"LoRA adapter {path}: no adapter_config.json")
    cfg = json.loads(cfg_file.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {path}: peft_type {cfg.get('peft_type')!r} is not LORA")
    for key, bad, why in (("use_dora", True, "DoRA"), ("fan_in_fan_out", True, "fan_in_fan_out weights")):
        if cfg.get(key) == bad:
            raise LoRAError(f"LoRA adapter {path}: {why} is not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise LoRAError(f"LoRA adapter {path}: adapter biases are not supported")
    if cfg.get("modules_to_save"):
        raise LoRAError(f"LoRA adapter {path}: modules_to_save ({cfg['modules_to_save']}) is not supported")
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise LoRAError(f"LoRA adapter {path}: per-module rank_pattern / alpha_pattern are not supported")
    rank, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    if rank > max_rank:
        raise LoRAError(f"LoRA adapter {path}: rank {rank} exceeds max_lora_rank={max_rank}")
    scale = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    file = path / "adapter_model.safetensors"
    if not file.is_file():
        raise LoRAError(f"LoRA adapter {path}: no adapter_model.safetensors")
    halves: dict[tuple[int, str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in read_tensors(file).items():
        m = _KEY.match(key)
        if m is None:
            raise LoRAError(
                f"LoRA adapter {path}: weight {key} targets a module kiln cannot adapt (it adapts {', '.join(TARGETS)})"
            )
        layer, name, half = int(m.group(1)), m.group(2), m.group(3)
        if name not in TARGETS or layer >= num_layers:
            raise LoRAError(f"LoRA adapter {path}: weight {key} has no place in this model")
        module, part = TARGETS[name]
        halves.setdefault((layer, module, part), {})[half] = tensor.float()
    out = {}
    for where, pair in halves.items():
        missing = {"A", "B"} - set(pair)
        if missing:
            raise LoRAError(f"LoRA adapter {path}: layer {where[0]} {where[1]} lacks lora_{missing.pop()}")
        out[where] = (pair["A"], pair["B"] * scale)
    if not out:
        raise LoRAError(f"LoRA adapter {path}: no LoRA weights")
    return out


class LoRAManager:
    """The adapters resident in the model's `max_loras` slots. Thread-safe."""

    def __init__(self, model: torch.nn.Module, max_loras: int, max_rank: int) -> None:
        self.model = model
        self.max_loras = max_loras
        self.max_rank = max_rank
        self._loaded: dict[str, _Loaded] = {}
        self._lock = threading.Lock()

    @property
    def adapters(self) -> list[LoRARequest]:
        return [entry.request for entry in self._loaded.values()]

    def get(self, name: str) -> _Loaded | None:
        return self._loaded.get(name)

    def why_not(self, request: LoRARequest) -> str | None:
        """Why `request`'s adapter cannot run now (None: it is loaded, or a slot is free for it).
        Admission refuses with it (engine/core/admission_rules/engine_limits.py lora_adapter)."""
        entry = self._loaded.get(request.lora_name)
        if entry is not None:
            if Path(entry.request.lora_path).expanduser() != Path(request.lora_path).expanduser():
                return f"LoRA adapter {request.lora_name!r} is already loaded from {entry.request.lora_path}"
            return None
        if len(self._loaded) >= self.max_loras:
            return (
                f"all max_loras={self.max_loras} LoRA slots hold adapters ({', '.join(self._loaded)}); unload one first"
            )
        return None

    def ensure(self, request: LoRARequest) -> _Loaded:
        """The adapter's slot, loading it into a free one first if needed."""
        with self._lock:
            why = self.why_not(request)
            if why is not None:
                raise LoRAError(why)
            entry = self._loaded.get(request.lora_name)
            if entry is not None:
                return entry
            used = {e.slot for e in self._loaded.values()}
            free = [s for s in range(self.max_loras) if s not in used]
            weights = read_adapter(request.lora_path, self.max_rank, len(self.model.layers))
            slot = free[0]
            self._write(slot, weights)
            entry = _Loaded(request, slot, adapter_root(request.lora_path))
            self._loaded[request.lora_name] = entry
            logger.info(
                "LoRA adapter %r loaded from %s into slot %d (%d projections)",
                request.lora_name,
                request.lora_path,
                slot,
                len(weights),
            )
            return entry

    def unload(self, name: str) -> None:
        with self._lock:
            entry = self._loaded.pop(name, None)
            if entry is None:
                raise LoRAError(f"no LoRA adapter named {name!r} is loaded")
            self._write(entry.slot, {})

    def _projections(self):
        """(layer index, kiln projection name, module) of every LoRA-capable projection."""
        names = sorted({m for m, _ in TARGETS.values()})
        for index, layer in enumerate(self.model.layers):
            for name in names:
                yield index, name, layer.get_submodule(name)

    def _check(self, weights: dict[tuple[int, str, int], tuple]) -> None:
        for (layer, name, part), (a, b) in weights.items():
            proj = self.model.layers[layer].get_submodule(name)
            size = proj.lora_parts[part][1]
            if a.shape[1] != proj.in_features or tuple(b.shape) != (size, a.shape[0]):
                raise LoRAError(
                    f"LoRA weights for layer {layer} {name} (part {part}) have shapes "
                    f"{tuple(a.shape)} / {tuple(b.shape)}; this model needs [r, {proj.in_features}] / "
                    f"[{size}, r]"
                )

    @torch.no_grad()
    def _write(self, slot: int, weights: dict[tuple[int, str, int], tuple]) -> None:
        """Zero the slot in every projection, then write the adapter's A and B into it."""
        self._check(weights)
        r_max = self.max_rank
        for layer_index, name, proj in self._projections():
            parts = proj.lora_parts
            cols = slice(slot * len(parts) * r_max, (slot + 1) * len(parts) * r_max)
            proj.lora_a[cols].zero_()
            proj.lora_b[:, cols].zero_()
            for part, (start, size) in enumerate(parts):
                pair = weights.get((layer_index, name, part))
                if pair is None:
                    continue
                a, b = pair
                first = (slot * len(parts) + part) * r_max
                proj.lora_a[first : first + a.shape[0]].copy_(a)
                proj.lora_b[start : start + size, first : first + a.shape[0]].copy_(b)


# ---- adapter admin for the engine (requests, load / unload between steps) ----
def make_lora_manager(model: torch.nn.Module, settings) -> LoRAManager | None:
    """Slots for LoRA adapters (settings.enable_lora), with lora_modules loaded; None when off."""
    if not settings.enable_lora:
        return None
    manager = LoRAManager(model, settings.max_loras, settings.max_lora_rank)
    for i, (name, path) in enumerate(settings.lora_module_map().items(), start=1):
        try:
            manager.ensure(LoRARequest(name, i, path))
        except LoRAError as exc:
            raise ValueError(f"lora_modules: {exc}") from exc
    return manager


def attach_lora(manager: LoRAManager, request, lora_request: LoRARequest) -> None:
    """Run `request` with this adapter (loaded into a free slot first if it is new). Admission
    found it can run (engine/core/admission_rules/engine_limits.py lora_adapter); a new adapter's files are read
    only now, between steps, so the loader's verdict on them (or a slot taken since admission)
    fails this request here."""
    try:
        entry = manager.ensure(lora_request)
    except LoRAError as exc:
        raise rules.adapter_unreadable(exc) from exc
    request.lora_request = lora_request
    request.lora_slot = entry.slot
    request.prefix_root = entry.prefix_root


def load_lora(manager: LoRAManager | None, name: str, path: str) -> LoRARequest:
    """Load an adapter into a free slot under a new id (call between steps)."""
    if manager is None:
        raise InvalidRequestError("LoRA adapters need the engine started with enable_lora", "lora_name")
    if manager.get(name) is not None:
        raise InvalidRequestError(f"a LoRA adapter named {name!r} is already loaded", "lora_name")
    lora_request = LoRARequest(name, max((a.lora_int_id for a in manager.adapters), default=0) + 1, path)
    try:
        manager.ensure(lora_request)
    except LoRAError as exc:
        raise InvalidRequestError(str(exc), "lora_path") from exc
    return lora_request


def unload_lora(manager: LoRAManager | None, requests, name: str) -> None:
    """Unload an adapter that none of `requests` (the unfinished ones) uses (call between steps)."""
    if manager is None or manager.get(name) is None:
        raise InvalidRequestError(f"no LoRA adapter named {name!r} is loaded", "lora_name")
    users = [
        r.request_id
        for r in requests
        if r.lora_request is not None and r.lora_request.lora_name == name and not r.is_finished
    ]
    if users:
        raise InvalidRequestError(f"LoRA adapter {name!r} is in use by {len(users)} unfinished requests", "lora_name")
    manager.unload(name)


# ---- the forward context's LoRA input (engine/worker/step_features.py) ----
class LoRASlots:
    """Each token's adapter slot (-1: the base model), a static buffer the model reads through
    ForwardContext.lora_slots: the decode CUDA graphs capture it like the attention metadata."""

    field = "lora_slots"

    def __init__(self, max_tokens: int, device: torch.device) -> None:
        self.host = torch.full((max_tokens,), -1, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.device = (
            self.host if device.type == "cpu" else torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        )
        self.np = self.host.numpy()

    def write(self, t: int, n: int, s) -> None:
        self.np[t : t + n] = s.lora_slot

    def write_decode(self, seqs) -> None:
        self.np[: len(seqs)] = [s.lora_slot for s in seqs]

    def pad(self, t: int, count: int) -> None:
        self.np[t : t + count] = -1

    def upload(self, num_tokens: int) -> None:
        if self.device is not self.host:
            self.device[:num_tokens].copy_(self.host[:num_tokens], non_blocking=True)

    def view(self, num_tokens: int) -> torch.Tensor:
        return self.device[:num_tokens]


def lora_step_feature(model: torch.nn.Module, max_tokens: int, device: torch.device) -> LoRASlots | None:
    """The model's LoRA step input, or None when LoRA is off (model.enable_lora was not called)."""
    return LoRASlots(max_tokens, device) if getattr(model, "lora_slots", 0) else None
