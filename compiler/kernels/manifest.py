"""The manifest of kernel variants (`templates/manifest.toml`) and template rendering."""

from __future__ import annotations

import itertools
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parents[2] / "templates"
MANIFEST_PATH = TEMPLATES_DIR / "manifest.toml"

DTYPE_CPP = {"bf16": "__nv_bfloat16", "fp16": "__half"}
# Parameters a manifest entry may list, in the order they appear in a variant's name.
_PARAM_ORDER = ("dtype", "head_dim", "block_size", "kv_dtype")
_NAME_PREFIX = {"dtype": "", "head_dim": "d", "block_size": "b", "kv_dtype": "kv"}
# KV cache element types other than the model's (`kv_dtype`; absent: the cache holds `dtype`).
KV_DTYPES = ("fp8",)
# Template constants that are not part of the variant's name.
DEFAULT_CONSTANTS = {"min_partition": 128}
# paged_decode_v2: minimum resident CTAs per SM (__launch_bounds__ hint) per packed group width.
DECODE_V2_MIN_BLOCKS = {"minb_g1": 4, "minb_g2": 4, "minb_g4": 3, "minb_g8": 2}


def prefill_tile(head_dim: int) -> dict:
    """Tile shape of the prefill kernel (shared by the template and the launcher)."""
    return {"block_m": 64, "block_n": 64}


def prefill_wgmma_tile(head_dim: int) -> dict:
    """Tile of the wgmma prefill kernel: 64 query rows per warpgroup, BN keys per K/V tile."""
    return {"wg_warpgroups": 2, "wg_block_n": 128}


def prefill_wgmma_smem_bytes(head_dim: int, elem_bytes: int = 2) -> int:
    t = prefill_wgmma_tile(head_dim)
    return (t["wg_warpgroups"] * 64 + 4 * t["wg_block_n"]) * head_dim * elem_bytes


def prefill_smem_bytes(head_dim: int, elem_bytes: int = 2) -> int:
    t = prefill_tile(head_dim)
    return (t["block_m"] + 4 * t["block_n"]) * head_dim * elem_bytes


class ManifestError(ValueError):
    pass


class TemplateRenderError(RuntimeError):
    pass


@dataclass(frozen=True)
class Variant:
    """One kernel variant: a template rendered with one set of parameters."""

    name: str
    kind: str
    template: str
    params: tuple[tuple[str, object], ...] = field(default=())

    @property
    def param_dict(self) -> dict:
        return dict(self.params)

    def render_context(self) -> dict:
        ctx = dict(DEFAULT_CONSTANTS)
        ctx.update(self.param_dict)
        if self.kind == "paged_decode_v2":
            ctx.update(DECODE_V2_MIN_BLOCKS)
        if self.kind == "flash_prefill":
            ctx.update(prefill_tile(int(ctx["head_dim"])))
        if self.kind == "flash_prefill_wgmma":
            ctx.update(prefill_wgmma_tile(int(ctx["head_dim"])))
        ctx["name"] = self.name
        ctx["kind"] = self.kind
        if "dtype" in ctx:
            ctx["dtype_cpp"] = DTYPE_CPP[ctx["dtype"]]
        ctx["kv_fp8"] = ctx.get("kv_dtype") == "fp8"  # e4m3 cache elements, per-layer scales
        return ctx


def variant_name(kind: str, params: dict) -> str:
    parts = [kind]
    for key in _PARAM_ORDER:
        if key in params:
            parts.append(f"{_NAME_PREFIX[key]}{params[key]}")
    return "_".join(parts)


def load_manifest(path: Path | None = None) -> dict[str, Variant]:
    """Expand the manifest into {variant name: Variant}, in manifest order."""
    path = Path(path) if path is not None else MANIFEST_PATH
    with open(path, "rb") as f:
        data = tomllib.load(f)
    variants: dict[str, Variant] = {}
    for entry in data.get("kernel", []):
        try:
            kind = entry["kind"]
            template = entry["template"]
        except KeyError as e:
            raise ManifestError(f"{path}: kernel entry {entry!r} lacks {e}") from None
        unknown = set(entry) - {"kind", "template", *_PARAM_ORDER}
        if unknown:
            raise ManifestError(f"{path}: kernel {kind!r}: unknown keys {sorted(unknown)}")
        keys = [k for k in _PARAM_ORDER if k in entry]
        lists = [entry[k] if isinstance(entry[k], list) else [entry[k]] for k in keys]
        for combo in itertools.product(*lists):
            params = dict(zip(keys, combo))
            if "dtype" in params and params["dtype"] not in DTYPE_CPP:
                raise ManifestError(f"{path}: kernel {kind!r}: unknown dtype {params['dtype']!r}")
            if "kv_dtype" in params and params["kv_dtype"] not in KV_DTYPES:
                raise ManifestError(f"{path}: kernel {kind!r}: unknown kv_dtype {params['kv_dtype']!r}")
            name = variant_name(kind, params)
            if name in variants:
                raise ManifestError(f"{path}: duplicate variant {name!r}")
            variants[name] = Variant(name, kind, template, tuple(params.items()))
    return variants


def select_variants(names, manifest: dict[str, Variant] | None = None) -> list[Variant]:
    """Variants by name (None: all). Unknown names raise with the list of known ones."""
    manifest = manifest if manifest is not None else load_manifest()
    if names is None:
        return list(manifest.values())
    out = []
    for n in names:
        if n not in manifest:
            raise ManifestError(f"unknown kernel variant {n!r}; known: {', '.join(manifest)}")
        out.append(manifest[n])
    return out


def render(variant: Variant, templates_dir: Path | None = None) -> str:
    """Render a variant's template with jinja2.

    `{{ include_raw("x.cuh") }}` inlines a shared header verbatim (not parsed by jinja, so
    inline PTX braces are safe), which makes the header part of the content hash.
    Raises TemplateRenderError naming the variant.
    """
    import jinja2

    tdir = Path(templates_dir or TEMPLATES_DIR)
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(tdir)),
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
    )
    env.globals["include_raw"] = lambda name: (tdir / name).read_text()
    try:
        return env.get_template(variant.template).render(**variant.render_context())
    except (jinja2.TemplateError, OSError) as e:
        raise TemplateRenderError(f"kernel variant {variant.name!r}: template {variant.template!r}: {e}") from e


# --- names the runtime needs for a given model shape ---------------------------------


def dtype_tag(dtype) -> str:
    s = str(dtype)
    if s.endswith("bfloat16"):
        return "bf16"
    if s.endswith("float16") or s.endswith("half"):
        return "fp16"
    raise ValueError(f"kiln kernels support bf16 and fp16, not {dtype}")


DECODE_KERNELS = {"v1": "paged_decode", "v2": "paged_decode_v2"}
PREFILL_KERNELS = {"mma": "flash_prefill", "wgmma": "flash_prefill_wgmma"}


def kv_dtype_tag(kv_dtype) -> str | None:
    """The manifest's kv_dtype of a KV cache element type (None: the model's own dtype)."""
    if kv_dtype is None:
        return None
    if str(kv_dtype).endswith("float8_e4m3fn"):
        return "fp8"
    raise ValueError(f"kiln kernels support an fp8 (e4m3) KV cache or the model's dtype, not {kv_dtype}")


def attention_variant_names(
    dtype,
    head_dim: int,
    block_size: int,
    decode_kernel: str | None = None,
    prefill_kernel: str | None = None,
    kv_dtype=None,
) -> dict[str, str]:
    """{kind: variant name} of the kernels one model shape needs: write_kv plus the selected decode
    (v1/v2) and prefill (mma/wgmma) generations; None selects every generation (what a build covers).
    kv_dtype: the KV cache's element type when it is not `dtype` (torch.float8_e4m3fn)."""
    t = dtype_tag(dtype)
    kv = kv_dtype_tag(kv_dtype)
    kinds = ["write_kv"]
    for choice, table, what in (
        (decode_kernel, DECODE_KERNELS, "decode_kernel"),
        (prefill_kernel, PREFILL_KERNELS, "prefill_kernel"),
    ):
        if choice is not None and choice not in table:
            raise ValueError(f"{what}: unknown value {choice!r} (expected one of {', '.join(table)})")
        kinds += list(table.values()) if choice is None else [table[choice]]
    shape = {"dtype": t, "head_dim": head_dim, "block_size": block_size}
    extra = {} if kv is None else {"kv_dtype": kv}
    return {k: variant_name(k, {"dtype": t, **extra} if k == "write_kv" else {**shape, **extra}) for k in kinds}
