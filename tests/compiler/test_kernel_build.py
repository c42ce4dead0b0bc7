"""Kernel build system: manifest, rendering, nvcc build + cache, ptxas report, loader errors.

The nvcc-dependent tests skip cleanly where nvcc is absent. No GPU needed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from compiler.kernels import build as kbuild
from compiler.kernels.build import KernelBuildError, build_kernels, parse_ptxas_report, read_index, source_hash
from compiler.kernels.loader import KernelLibrary, MissingKernelError
from compiler.kernels.manifest import TEMPLATES_DIR, Variant, attention_variant_names, load_manifest, render

needs_nvcc = pytest.mark.skipif(kbuild.find_nvcc() is None, reason="nvcc not on PATH")


def test_manifest_covers_every_supported_shape():
    m = load_manifest()
    assert len(m) == len(set(m))
    for dt in ("bfloat16", "float16"):
        for d in (64, 128):
            for bs in (16, 32):
                names = attention_variant_names(f"torch.{dt}", d, bs)
                for n in names.values():
                    assert n in m, f"{n} missing from templates/manifest.toml"


def test_render_substitutes_parameters():
    v = load_manifest()["paged_decode_fp16_d64_b32"]
    text = render(v)
    assert "constexpr int D = 64;" in text
    assert "constexpr int BS = 32;" in text
    assert "using elem_t = __half;" in text
    assert "kiln_paged_decode_fp16_d64_b32_combine" in text
    assert "namespace kiln" in text  # the shared header is inlined (so it is hashed)
    assert "{{" not in text and "include_raw" not in text


def test_hash_changes_with_text_and_parameters():
    m = load_manifest()
    v = m["write_kv_bf16"]
    text = render(v)
    h = source_hash(v, text)
    assert h == source_hash(v, render(v))  # deterministic
    assert source_hash(v, text + "\n// changed\n") != h
    other = Variant(v.name, v.kind, v.template, (("dtype", "fp16"),))
    assert source_hash(other, text) != h
    assert source_hash(v, text, flags=kbuild.NVCC_FLAGS + ("-G",)) != h
    assert kbuild.build_key(h, "nvcc 13.0") != kbuild.build_key(h, "nvcc 12.8")


PTXAS_SAMPLE = """\
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'kiln_a' for 'sm_90a'
ptxas info    : Function properties for kiln_a
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 8320 bytes smem, 512 bytes cmem[0]
ptxas info    : Compiling entry function 'kiln_b' for 'sm_90a'
ptxas info    : Function properties for kiln_b
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 31 registers, used 0 barriers, 400 bytes cmem[0]
"""


def test_parse_ptxas_report():
    r = parse_ptxas_report(PTXAS_SAMPLE)
    assert set(r) == {"kiln_a", "kiln_b"}
    a, b = r["kiln_a"], r["kiln_b"]
    assert (a.registers, a.shared_bytes, a.stack_bytes, a.spill_stores, a.spill_loads, a.barriers) == (
        168,
        8320,
        16,
        8,
        4,
        1,
    )
    assert (b.registers, b.shared_bytes, b.spill_stores, b.barriers) == (31, 0, 0, 0)


def test_loader_names_the_build_command_for_a_missing_variant(tmp_path):
    with pytest.raises(MissingKernelError) as ei:
        KernelLibrary(tmp_path, ["paged_decode_bf16_d128_b16"])
    msg = str(ei.value)
    assert "kiln build-kernels --variants paged_decode_bf16_d128_b16" in msg
    assert str(tmp_path) in msg


def test_cli_rejects_unknown_variant(capsys):
    from compiler.kernels.cli import build_main

    assert build_main(["--variants", "no_such_variant", "--cache-dir", "/nonexistent", "--quiet"]) == 2
    assert "no_such_variant" in capsys.readouterr().err


@pytest.fixture(scope="module")
def full_build(kernel_build_in_background):
    """Every manifest variant, built once per session by nvcc (~3 min of CPU on 2 cores), in the
    background from the session's start (tests/support/kernel_build.py; these tests run last):
    (cache, results, the nvcc command lines)."""
    if kernel_build_in_background is None:
        pytest.skip("nvcc not on PATH")
    cache, commands, built = kernel_build_in_background.wait()
    assert sorted(b["name"] for b in built) == sorted(load_manifest()) and not any(b["cached"] for b in built)
    results = build_kernels(cache, None, progress=False)  # every one a hit now: the results as built
    assert [(r.name, r.key) for r in results] == [(b["name"], b["key"]) for b in built]
    return cache, results, commands


def test_only_cutlass_templates_get_the_cutlass_include_path():
    """Templates that include no CUTLASS/CuTe header build without nvidia-cutlass (the GPU machine
    has nvcc but not the headers); the flash prefill kernels need them."""
    m = load_manifest()
    needs = {name for name, v in m.items() if kbuild.needs_cutlass(render(v))}
    assert needs == {name for name, v in m.items() if v.kind in ("flash_prefill", "flash_prefill_wgmma")}
    assert kbuild.needs_cutlass("#include <cute/tensor.hpp>\n") and kbuild.needs_cutlass(' # include "cutlass/x.h"')
    assert not kbuild.needs_cutlass("// #include <cute/tensor.hpp> is not here\n#include <cuda_fp16.h>\n")


@needs_nvcc
def test_every_build_without_cutlass_headers_ran_without_the_include_path(full_build):
    cache, results, commands = full_build
    keys = {r.key[:12]: r.name for r in results}
    manifest = load_manifest()
    seen = set()
    for cmd in commands:
        out = Path(cmd[cmd.index("-o") + 1])
        name = keys[out.parent.name[1:13]]  # (built in <cache>/objects/xx/.<key[:12]>.*/)
        seen.add(name)
        has_include = any(a.startswith("-I") for a in cmd)
        assert has_include == (manifest[name].kind in ("flash_prefill", "flash_prefill_wgmma")), (name, cmd)
    assert seen == set(manifest)


@needs_nvcc
def test_cli_check_no_build_and_prune(full_build, tmp_path, capsys):
    """--check --no-build (the local check before a device call) reports hits and stale variants
    and builds nothing; --prune drops objects the index does not refer to."""
    from compiler.kernels.cli import build_main

    cache, _, _ = full_build
    copy = tmp_path / "cache"
    shutil.copytree(cache, copy)
    stale = copy / "objects" / "zz" / ("z" * 64)
    stale.mkdir(parents=True)
    (stale / "kernel.cubin").write_bytes(b"an older build")
    report = tmp_path / "r.json"
    assert build_main(["--check", "--no-build", "--cache-dir", str(copy), "--json", str(report), "--prune"]) == 0
    r = json.loads(report.read_text())
    assert (r["hits"], r["missing"], r["unreferenced_objects"]) == (len(load_manifest()), [], 1)
    assert not stale.exists() and "1 objects and 0 index entries removed" in capsys.readouterr().out
    # a template changed since the build: the check fails and names the stale variant, nothing is built
    tdir = tmp_path / "templates"
    shutil.copytree(TEMPLATES_DIR, tdir)
    (tdir / "write_kv.cu.j2").write_text((tdir / "write_kv.cu.j2").read_text() + "\n// changed\n")
    import compiler.kernels.loader as kloader

    real = kloader.TEMPLATES_DIR
    kloader.TEMPLATES_DIR = tdir
    try:
        assert (
            build_main(["--check", "--no-build", "--cache-dir", str(copy), "--variants", "write_kv_bf16,write_kv_fp16"])
            == 1
        )
    finally:
        kloader.TEMPLATES_DIR = real
    assert (
        "missing or stale (templates changed since the build): write_kv_bf16, write_kv_fp16" in capsys.readouterr().out
    )


@needs_nvcc
def test_every_variant_compiles_without_spills(full_build):
    cache, results, _ = full_build
    manifest = load_manifest()
    assert {r.name for r in results} == set(manifest)
    index = read_index(cache)
    for r in results:
        assert r.cubin.exists() and r.cubin.stat().st_size > 0
        assert (r.cubin.parent / "ptxas.txt").exists()
        assert r.name in index and index[r.name]["functions"]
        assert r.resources, f"{r.name}: no ptxas resource report parsed"
        for fn, res in r.resources.items():
            assert res.registers > 0, f"{fn}: register count not parsed"
            assert res.spill_stores == 0 and res.spill_loads == 0, f"{fn} spills: {res}"
            assert res.stack_bytes == 0, f"{fn} has a local-memory stack frame: {res}"
        kind = manifest[r.name].kind
        fns = set(r.resources)
        if kind == "paged_decode":
            assert fns == {f"kiln_{r.name}_{e}" for e in ("g1", "g2", "g4", "g8", "combine")}
        elif kind == "paged_decode_v2":
            assert fns == {f"kiln_{r.name}_{e}" for e in ("g1", "g2", "g4", "g8")}
        elif kind == "w4a16_gemm":
            assert fns == {f"kiln_{r.name}_t{t}" for t in (1, 2, 4)}
        else:
            assert fns == {f"kiln_{r.name}"}


@needs_nvcc
def test_second_build_is_a_cache_hit(full_build, monkeypatch):
    cache, _, _ = full_build

    def no_nvcc(cmd):
        raise AssertionError(f"nvcc was called on a cache hit: {cmd}")

    monkeypatch.setattr(kbuild, "_run_nvcc", no_nvcc)
    again = build_kernels(cache, ["write_kv_bf16", "flash_prefill_bf16_d128_b16"], progress=False)
    assert all(r.cached for r in again)
    # and the loader finds them without nvcc
    lib = KernelLibrary(cache, ["write_kv_bf16", "flash_prefill_bf16_d128_b16"])
    assert lib.cubin_path("write_kv_bf16").exists()
    assert lib.resources("flash_prefill_bf16_d128_b16")["kiln_flash_prefill_bf16_d128_b16"].registers > 0


@needs_nvcc
def test_template_change_rebuilds_and_loader_detects_stale(full_build, tmp_path):
    cache, results, _ = full_build
    before = {r.name: r.key for r in results}["write_kv_bf16"]
    tdir = tmp_path / "templates"
    shutil.copytree(TEMPLATES_DIR, tdir)
    with open(tdir / "write_kv.cu.j2", "a") as f:
        f.write("\n// a harmless change\n")
    # the cache built from the original templates is stale for the changed ones
    with pytest.raises(MissingKernelError, match="stale"):
        KernelLibrary(cache, ["write_kv_bf16"], templates_dir=tdir)
    calls = []
    real = kbuild._run_nvcc

    def counting(cmd):
        calls.append(cmd)
        return real(cmd)

    kbuild._run_nvcc = counting
    try:
        (r,) = build_kernels(
            cache, ["write_kv_bf16"], templates_dir=tdir, progress=False, manifest=load_manifest(tdir / "manifest.toml")
        )
    finally:
        kbuild._run_nvcc = real
    assert not r.cached and len(calls) == 1 and r.key != before
    KernelLibrary(cache, ["write_kv_bf16"], templates_dir=tdir)  # fresh again


@needs_nvcc
def test_broken_template_reports_nvcc_error_and_variant(tmp_path):
    tdir = tmp_path / "templates"
    tdir.mkdir()
    (tdir / "broken.cu.j2").write_text(
        'extern "C" __global__ void kiln_{{ name }}(int* p) { p[0] = undeclared_identifier_xyz; }\n'
    )
    v = Variant("broken_bf16", "broken", "broken.cu.j2", (("dtype", "bf16"),))
    with pytest.raises(KernelBuildError) as ei:
        build_kernels(tmp_path / "cache", [v], templates_dir=tdir, progress=False)
    e = ei.value
    assert e.variant == "broken_bf16"
    assert "broken_bf16" in str(e)
    assert "undeclared_identifier_xyz" in str(e) and "error" in str(e).lower()
    assert not read_index(tmp_path / "cache").get("broken_bf16")


@needs_nvcc
def test_cli_build_and_list(tmp_path, capsys):
    from compiler.kernels.cli import build_main

    assert build_main(["--variants", "write_kv_fp16", "--cache-dir", str(tmp_path), "--quiet"]) == 0
    assert "kiln_write_kv_fp16" in capsys.readouterr().out
    assert build_main(["--variants", "write_kv_fp16,write_kv_bf16", "--cache-dir", str(tmp_path), "--list"]) == 0
    out = capsys.readouterr().out
    assert "write_kv_fp16" in out and "built" in out
    assert "write_kv_bf16" in out and "missing" in out


@needs_nvcc
def test_cli_check_builds_only_what_is_missing(tmp_path):
    """`--check` (the device run's kernel-cache stage): hits need no build; misses are built once."""
    import json

    from compiler.kernels.cli import build_main
    from compiler.kernels.loader import missing_variants

    names = ["write_kv_fp16", "write_kv_bf16"]
    assert missing_variants(tmp_path, names) == names
    assert build_main(["--variants", "write_kv_fp16", "--cache-dir", str(tmp_path), "--quiet"]) == 0
    assert missing_variants(tmp_path, names) == ["write_kv_bf16"]
    report = tmp_path / "check.json"
    assert (
        build_main(["--check", "--variants", ",".join(names), "--cache-dir", str(tmp_path), "--json", str(report)]) == 0
    )
    first = json.loads(report.read_text())
    assert (first["hits"], first["missing"], first["built"], first["still_missing"]) == (1, ["write_kv_bf16"], 1, [])
    assert (
        build_main(["--check", "--variants", ",".join(names), "--cache-dir", str(tmp_path), "--json", str(report)]) == 0
    )
    again = json.loads(report.read_text())
    assert again["hits"] == 2 and "built" not in again
