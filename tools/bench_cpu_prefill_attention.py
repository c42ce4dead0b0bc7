"""A long prompt's prefill attention on the CPU: one layer's call for a chunk of --rows query rows
ending at each --ctx keys, kiln's C++ paged kernel (compiler/kernels/cpu_attention.py) against
torch's SDPA on contiguous float32 copies of the same keys and values (causal, the chunk at the
end), the two interleaved so that load hits them alike. Prints the best of --reps of each, their
ratio, and the kernel's GFLOP/s (QK^T and PV over the keys each row sees).

    PYTHONPATH=$PWD python tools/bench_cpu_prefill_attention.py [--ctx 4096,16384] [--rows 2048]
        [--heads 9,3,64] [--threads 2] [--dtype float16,float32] [--old REV]

How the kernel's time grows with the keys shows whether it reuses a block of keys across the
chunk's rows: linear in the keys when it does, worse when every row streams them again.
--old REV: also the kernel of git revision REV (its templates/cpu_paged_attention.cpp and the .inc
files it includes, built once into /tmp under the op namespace kiln_cpu_old), interleaved with the
other two, and its time against the current kernel's.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from compiler.kernels import cpu_extension  # noqa: E402
from compiler.kernels.cpu_attention import cpu_flags, paged_attention_cpu_impl  # noqa: E402
from tools.bench_cpu_attention import BS, inputs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def load_old_kernel(rev: str):
    """torch.ops.kiln_cpu_old.paged_attention: the kernel source of git revision `rev`, its library
    namespace renamed so that it loads beside the current one."""

    def show(name: str) -> str:
        cmd = ["git", "show", f"{rev}:templates/{name}"]
        return subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout

    files = {"cpu_paged_attention.cpp": show("cpu_paged_attention.cpp")}
    files.update({inc: show(inc) for inc in re.findall(r'#include "(\w+\.inc)"', files["cpu_paged_attention.cpp"])})
    files["cpu_paged_attention.cpp"] = re.sub(
        r"TORCH_LIBRARY(_IMPL)?\(kiln_cpu,", r"TORCH_LIBRARY\1(kiln_cpu_old,", files["cpu_paged_attention.cpp"]
    )
    key = hashlib.sha256(repr(sorted(files.items())).encode() + repr(cpu_flags()).encode()).hexdigest()[:16]
    work = Path(tempfile.gettempdir()) / f"kiln-bench-old-attention-{key}"
    work.mkdir(exist_ok=True)
    for name, text in files.items():
        (work / name).write_text(text)
    lib = work / "build" / f"kiln_old_attention_{key}.so"
    if lib.is_file():
        torch.ops.load_library(str(lib))
    else:
        cpu_extension.build(lib, work / "cpu_paged_attention.cpp", cpu_flags())
    return torch.ops.kiln_cpu_old.paged_attention


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ctx", default="4096,16384", help="keys the chunk ends at (comma-separated)")
    p.add_argument("--rows", type=int, default=2048, help="the chunk's query rows (the default step budget)")
    p.add_argument("--heads", default="9,3,64", help="query heads, KV heads, head dim (default: SmolLM2-135M's)")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--dtype", default="float16,float32", help="KV cache dtypes (comma-separated)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--old", metavar="REV", help="also time the kernel of this git revision (e.g. main)")
    a = p.parse_args()
    old = load_old_kernel(a.old) if a.old else None
    torch.set_num_threads(a.threads)
    hq, hkv, d = (int(x) for x in a.heads.split(","))
    g = torch.Generator().manual_seed(0)
    print(f"{a.rows}-row chunk, heads {hq}/{hkv}x{d}, {a.threads} threads; best of {a.reps}")
    for ctx in (int(x) for x in a.ctx.split(",")):
        for name in a.dtype.split(","):
            dtype = getattr(torch, name)
            q, kv, qsl, lens, tables = inputs(g, [a.rows], [ctx], hq, hkv, d, dtype)
            out = torch.empty_like(q)
            ids = tables[0, : -(-ctx // BS)].long()
            k, v = (kv[0, i][ids].reshape(-1, hkv, d)[:ctx].float().transpose(0, 1) for i in (0, 1))
            k, v = (x.repeat_interleave(hq // hkv, 0) for x in (k, v))
            qf = q.float().transpose(0, 1)
            mask = torch.ones(a.rows, ctx, dtype=torch.bool).tril(ctx - a.rows)
            kiln, sdpa, before = [], [], []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                paged_attention_cpu_impl(out, q, kv, 0, qsl, lens, tables, d**-0.5, a.rows, ctx)
                kiln.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                want = torch.nn.functional.scaled_dot_product_attention(qf, k, v, attn_mask=mask)
                sdpa.append(time.perf_counter() - t0)
                if old is not None:
                    out_old = torch.empty_like(q)
                    t0 = time.perf_counter()
                    old(out_old, q, kv, 0, qsl, lens, tables, d**-0.5, 0, 0.0, None, None)
                    before.append(time.perf_counter() - t0)
            seen = sum(ctx - a.rows + r + 1 for r in range(a.rows))  # keys each causal row sees
            flops = 4 * seen * hq * d
            err = (out.float() - want.transpose(0, 1)).abs().max().item()
            line = (
                f"ctx {ctx:6d} KV {name:8s}: kiln {min(kiln) * 1e3:8.1f} ms ({flops / min(kiln) / 1e9:5.1f} GFLOP/s), "
                f"SDPA {min(sdpa) * 1e3:8.1f} ms, kiln / SDPA time {min(kiln) / min(sdpa):.2f}, "
                f"max |kiln - SDPA| {err:.1e}"
            )
            if before:
                line += f"; {a.old} {min(before) * 1e3:8.1f} ms, {a.old} / kiln time {min(before) / min(kiln):.2f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
