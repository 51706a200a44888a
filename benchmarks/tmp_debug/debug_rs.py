import sys, torch
sys.path.insert(0, "."); sys.path.insert(0, "benchmarks")
import fp4moe_ops
from bench_moe import error_vs_reference, make_inputs, random_weights
from fp4moe_ops.backends.triton_moe import launch, prefill_rs, prefill_ws
from fp4moe_ops.backends.triton_moe.layout import fragment_column

torch.manual_seed(0)
orig_empty = torch.empty
def nan_empty(*a, **kw):
    t = orig_empty(*a, **kw)
    if t.is_floating_point(): t.fill_(float("nan"))
    return t

def run(e, h, i, k, t, poison):
    w = random_weights(e, h, i, "cuda")
    ref_impl = fp4moe_ops.prepare_experts(w, "reference")
    tensors = fp4moe_ops.prepare_experts(w, "triton").op_tensors()
    x, ids, rw = make_inputs(t, h, k, e, "cuda", n=1)[0]
    ref = ref_impl(x, ids, rw)
    w13, s13, g13, w2, s2, g2 = tensors
    ss, be, rs_, re_ = launch.route(ids, e, 128)
    xs = prefill_rs.gather_fragment_order(x, ss.long() // k)
    if poison: torch.empty = nan_empty
    try:
        y = prefill_rs.rs_prefill_gemms(xs, w13, s13, g13, w2, s2, g2, rw.float().contiguous(), ss, be, rs_, re_)
        y_ws = prefill_ws.ws_prefill_gemms(x.index_select(0, ss.long() // k), w13, s13, g13, w2, s2, g2,
                                           rw.float().contiguous(), ss, be, rs_, re_)
    finally:
        torch.empty = orig_empty
    out = launch._sum_topk(y, ids, x, e)
    nan_slots = y.isnan().any(1)
    bad_cols = y.isnan().any(0).nonzero().flatten()
    err = error_vs_reference(out[~out.isnan().any(1)].double(), ref[~out.isnan().any(1)].double()) if (~out.isnan().any(1)).any() else float("nan")
    d = (y - y_ws).abs().max().item()
    print(f"E={e} H={h} I={i} k={k} T={t} poison={poison}: nan slots {int(nan_slots.sum())}/{y.shape[0]}, "
          f"nan cols {bad_cols.numel()} first {bad_cols[:8].tolist()}, err(non-nan tokens) {err:.2e}, max|y-y_ws| {d:.3e}", flush=True)

for cfg in [(8, 1024, 512, 2, 300), (8, 7168, 512, 2, 300), (8, 1024, 2048, 2, 300), (8, 7168, 2048, 2, 300),
            (256, 7168, 2048, 8, 64), (8, 2048, 512, 2, 300), (8, 1536, 512, 2, 300)]:
    for poison in (False, True):
        try:
            run(*cfg, poison)
        except Exception as exc:
            print(cfg, poison, "FAILED", type(exc).__name__, str(exc)[:300], flush=True)
