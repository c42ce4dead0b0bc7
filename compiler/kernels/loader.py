"""Serve-time kernel loading: cubins from the build cache -> CUfunctions (cuda-python).

Never compiles: a variant that is not in the cache (or whose cubin is stale because the
templates changed) raises MissingKernelError naming the `kiln build-kernels` command.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

from compiler.kernels.build import read_index, resources_from_json, source_hash
from compiler.kernels.manifest import TEMPLATES_DIR, load_manifest, render


class MissingKernelError(RuntimeError):
    def __init__(self, variants: list[str], cache_dir: Path, reason: str = "not built"):
        self.variants = list(variants)
        names = ",".join(self.variants)
        super().__init__(
            f"kernel variant(s) {names} {reason} in {cache_dir}; run "
            f"`kiln build-kernels --variants {names} --cache-dir {cache_dir}` on a machine with nvcc"
        )


class CudaDriverError(RuntimeError):
    pass


def _driver():
    from cuda.bindings import driver  # cuda-python >= 12.6 layout

    return driver


def check(result, what: str = "CUDA driver call"):
    """Unpack a cuda-python `(CUresult, *values)` return, raising on any error."""
    drv = _driver()
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if err != drv.CUresult.CUDA_SUCCESS:
        name = drv.cuGetErrorName(err)
        ename = name[1].decode() if name[0] == drv.CUresult.CUDA_SUCCESS else str(err)
        raise CudaDriverError(f"{what} failed: {ename} ({int(err)})")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def ensure_torch_context(device) -> object:
    """Make torch's primary context for `device` current on this thread; return it."""
    import torch

    drv = _driver()
    device = torch.device(device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    with torch.cuda.device(index):
        torch.empty(1, device=f"cuda:{index}")  # forces torch to create/bind the primary context
        check(drv.cuInit(0), "cuInit")
        ctx = check(drv.cuCtxGetCurrent(), "cuCtxGetCurrent")
        dev = check(drv.cuDeviceGet(index), "cuDeviceGet")
        primary = check(drv.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
        if ctx is None or int(ctx) != int(primary):
            check(drv.cuCtxSetCurrent(primary), "cuCtxSetCurrent")
    return primary


class KernelLibrary:
    """The cubins of `variants` from `cache_dir`'s index, loaded lazily into CUDA modules.

    Construction only checks the cache (no CUDA): MissingKernelError if a variant is
    absent, its cubin file is gone, or (verify_source) the templates changed since it was built.
    """

    def __init__(self, cache_dir, variants, *, verify_source: bool = True, templates_dir: Path | None = None):
        self.cache_dir = Path(cache_dir).expanduser()
        self.variants = list(variants)
        index = read_index(self.cache_dir)
        missing = [v for v in self.variants if v not in index or not (self.cache_dir / index[v]["cubin"]).exists()]
        if missing:
            raise MissingKernelError(missing, self.cache_dir)
        self.records = {v: index[v] for v in self.variants}
        tdir = Path(templates_dir or TEMPLATES_DIR)
        if verify_source and (tdir / "manifest.toml").exists():
            manifest = load_manifest(tdir / "manifest.toml")
            stale = []
            for v in self.variants:
                if v not in manifest:
                    continue
                if source_hash(manifest[v], render(manifest[v], tdir)) != self.records[v]["source_hash"]:
                    stale.append(v)
            if stale:
                raise MissingKernelError(stale, self.cache_dir, "are stale (templates changed since the build)")
        self._modules: dict[str, object] = {}
        self._functions: dict[tuple[str, str], object] = {}
        self.context = None

    def cubin_path(self, variant: str) -> Path:
        return self.cache_dir / self.records[variant]["cubin"]

    def resources(self, variant: str):
        return resources_from_json(self.records[variant].get("resources", {}))

    def load(self, device="cuda") -> "KernelLibrary":
        """Load every variant's cubin into torch's primary context of `device`."""
        drv = _driver()
        self.context = ensure_torch_context(device)
        for v in self.variants:
            if v in self._modules:
                continue
            data = self.cubin_path(v).read_bytes()
            self._modules[v] = check(drv.cuModuleLoadData(data), f"cuModuleLoadData({v})")
        return self

    def function(self, variant: str, entry: str | None = None, max_dynamic_smem: int = 0):
        """CUfunction `kiln_<variant>[_<entry>]`; sets the dynamic smem limit if > 48 KiB."""
        drv = _driver()
        if variant not in self._modules:
            self.load()
        fname = f"kiln_{variant}" + (f"_{entry}" if entry else "")
        key = (variant, fname)
        if key not in self._functions:
            fn = check(drv.cuModuleGetFunction(self._modules[variant], fname.encode()), f"cuModuleGetFunction({fname})")
            self._functions[key] = fn
        fn = self._functions[key]
        if max_dynamic_smem > 48 * 1024:
            check(
                drv.cuFuncSetAttribute(
                    fn, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, max_dynamic_smem
                ),
                f"cuFuncSetAttribute({fname}, max dynamic smem {max_dynamic_smem})",
            )
        return fn


def missing_variants(cache_dir, variants) -> list[str]:
    """The variants the loader would not find in cache_dir (absent or stale); needs no nvcc, no GPU."""
    missing = []
    for v in variants:  # one at a time: MissingKernelError names only the first kind of failure
        try:
            KernelLibrary(cache_dir, [v])
        except MissingKernelError:
            missing.append(v)
    return missing


def max_active_ctas_per_sm(fn, threads: int, dynamic_smem: int = 0) -> int:
    """The driver's occupancy answer for a loaded kernel: CTAs of `threads` threads that fit on one SM."""
    drv = _driver()
    return int(
        check(
            drv.cuOccupancyMaxActiveBlocksPerMultiprocessor(fn, threads, dynamic_smem),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor",
        )
    )


class Launcher:
    """A prepared kernel launch: the CUfunction, block shape, smem and ctypes argument types."""

    __slots__ = ("fn", "block", "smem", "types", "name", "_launch", "_ok", "_context")

    def __init__(self, fn, block: int, smem: int, types: tuple, name: str, context=None):
        drv = _driver()
        self.fn, self.block, self.smem, self.types, self.name = fn, block, smem, types, name
        self._launch = drv.cuLaunchKernel
        self._ok = drv.CUresult.CUDA_SUCCESS
        self._context = context

    def __call__(self, grid: tuple[int, int, int], stream: int, args: tuple) -> None:
        err = self._launch(
            self.fn, grid[0], grid[1], grid[2], self.block, 1, 1, self.smem, stream, (args, self.types), 0
        )
        err = err[0] if isinstance(err, tuple) else err
        if err != self._ok:
            drv = _driver()
            if err == drv.CUresult.CUDA_ERROR_INVALID_CONTEXT and self._context is not None:
                # A thread on which torch never bound the primary context: bind it and retry.
                check(drv.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")
                check(
                    self._launch(
                        self.fn, grid[0], grid[1], grid[2], self.block, 1, 1, self.smem, stream, (args, self.types), 0
                    ),
                    f"cuLaunchKernel({self.name})",
                )
                return
            check((err,), f"cuLaunchKernel({self.name}, grid={grid})")


PTR = ctypes.c_void_p
I32 = ctypes.c_int
I64 = ctypes.c_longlong
F32 = ctypes.c_float
