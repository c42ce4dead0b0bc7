"""Print the decode split-KV plans for the kernel bench grid (32q/8kv, D128): the old fixed-target
plans (v1: 12 CTAs per SM, v2: 4 per SM, 256-token splits) against the occupancy plan of
compiler/kernels/launch_plan.py, as CTAs, waves and wave efficiency at the measured occupancy. Computed,
not measured: the GPU timings come from `kiln bench kernels` in tools/gpu_check.sh."""

from compiler.kernels.launch_plan import ctas_per_sm_from_resources as occ
from compiler.kernels.launch_plan import plan_decode_splits as plan
from compiler.kernels.launch_plan import wave_efficiency as eff

SMS, HKV = 132, 8
cps = occ(168, 128, 8320)  # decode g4 (32q/8kv), ptxas: 168 registers, 8320 B static smem


def old(work, ctx, target, min_tok):
    return max(1, min(max(1, -(-target // work)), 64, max(1, -(-ctx // min_tok))))


print(f"occupancy g4: {cps} CTAs/SM, wave = {cps * SMS} CTAs")
print(
    "| B | ctx | v1 old splits | CTAs | waves | eff | v2 old splits | CTAs | waves | eff "
    "| new v1 splits | CTAs | waves | eff | new v2 splits | CTAs | waves | eff |"
)
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for B in (1, 16, 64, 256):
    for ctx in (128, 2048, 32768):
        w = B * HKV
        cells = []
        for s in (
            old(w, ctx, 12 * SMS, 128),
            old(w, ctx, 4 * SMS, 256),
            plan(w, ctx, cps, SMS, 128, 64),
            plan(w, ctx, cps, SMS, 64, 64),
        ):
            c = w * s
            cells += [s, c, f"{c / (cps * SMS):.2f}", f"{eff(c, cps, SMS):.2f}"]
        print(f"| {B} | {ctx} | " + " | ".join(map(str, cells)) + " |")
