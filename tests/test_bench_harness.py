"""The benchmark harness's kernel timing (zeroinfer.testing.bench.time_kernels): how CUPTI
records are cut into calls, on synthetic records, and one real measurement on the GPU."""

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from zeroinfer.testing import bench


def _records(calls, kernels, flush=("reduce_kernel",), seed=0):
    """(name, start, duration) records of `calls` calls: the flush's records, then `kernels`
    kernels."""
    rng = random.Random(seed)
    recs, want, t = [], [], 0.0
    for _ in range(calls):
        for name in flush:
            recs.append((name, t, 50.0))
            t += 55.0
        total = 0.0
        for j in range(kernels):
            d = rng.uniform(1.0, 30.0)
            recs.append((f"kernel_{j}", t, d))
            t += d + rng.uniform(0.5, 3.0)  # launch gaps are not counted
            total += d
        want.append(total)
    return recs, want


@pytest.mark.parametrize("kernels", [1, 3])
def test_call_busy_sums_each_calls_records_when_none_overlap(kernels):
    recs, want = _records(calls=7, kernels=kernels, seed=kernels)
    got = bench.call_busy_us(recs, 7, ["reduce_kernel"])
    assert got == pytest.approx(want)


def test_call_busy_skips_a_flush_of_several_records():
    flush = ("Memset (Device)", "reduce_kernel")
    recs, want = _records(calls=5, kernels=2, flush=flush, seed=3)
    assert bench.call_busy_us(recs, 5, list(flush)) == pytest.approx(want)
    with pytest.raises(RuntimeError, match="start with the L2 flush"):  # the order matters
        bench.call_busy_us(recs, 5, list(flush[::-1]))


def test_call_busy_without_flush():
    recs, want = _records(calls=4, kernels=2, seed=5)
    recs = [r for r in recs if r[0] != "reduce_kernel"]
    assert bench.call_busy_us(recs, 4, []) == pytest.approx(want)


def test_call_busy_rejects_uneven_or_misaligned_records():
    recs, _ = _records(calls=3, kernels=2)
    with pytest.raises(RuntimeError, match="device records for 3 calls"):
        bench.call_busy_us(recs[:-1], 3, ["reduce_kernel"])
    with pytest.raises(RuntimeError, match="start with the L2 flush"):
        bench.call_busy_us(recs[1:] + recs[:1], 3, ["reduce_kernel"])


def test_call_busy_counts_overlapping_records_once(gen):
    # Programmatic launches: each kernel may start before the previous one (or the flush) ends.
    # The busy time is the union of the call's intervals after the flush, checked against a
    # 1-ns grid that marks every busy instant.
    calls, kernels = 6, 4
    recs, want, t = [], [], 0.0
    for _ in range(calls):
        recs.append(("reduce_kernel", t, 50.0))
        flush_end = t + 50.0
        t = flush_end - float(torch.rand(1, generator=gen)) * 5.0  # starts under the flush
        grid = set()
        for j in range(kernels):
            d = 1.0 + float(torch.rand(1, generator=gen)) * 20.0
            recs.append((f"kernel_{j}", t, d))
            grid |= {i for i in range(round(t * 1000), round((t + d) * 1000))
                     if i >= round(flush_end * 1000)}
            # the next one starts under this one, or after a gap
            t += d * float(torch.rand(1, generator=gen)) * 1.3
        want.append(len(grid) / 1000)
        t = max(t, max(s + d for _, s, d in recs[-kernels:])) + 2.0
    got = bench.call_busy_us(recs, calls, ["reduce_kernel"])
    assert got == pytest.approx(want, abs=kernels * 2e-3)
    per = kernels + 1  # a call: its flush, then its kernels
    sums = [sum(d for n, _, d in recs[i * per + 1:(i + 1) * per]) for i in range(calls)]
    assert all(g <= s + 1e-9 for g, s in zip(got, sums))


def test_l2_flush_names_a_bad_mode():
    with pytest.raises(ValueError, match="mode must be 'read' or 'memset'"):
        bench.l2_flush("evict")


@pytest.mark.gpu
def test_time_kernels_counts_the_ops_kernels_not_the_flush():
    # Two elementwise kernels over 64 MiB each way: device work of a few tens of us, far below the
    # 256 MiB flush that precedes every call; and the per-call sum is below the event time.
    x = torch.randn(16 << 20, device="cuda")
    y = torch.empty_like(x)

    def fn():
        torch.mul(x, 2.0, out=y)
        y.add_(1.0)

    t_kern = bench.time_kernels(fn, reps=10)
    t_events = bench.time_cuda(fn, reps=10)
    assert 0 < t_kern <= t_events
    # At least the bytes at the copy ceiling the device can reach (a loose physical bound).
    assert t_kern > 4 * x.numel() * 4 / 10e12


@pytest.mark.gpu
def test_stream_read_reads_every_byte_of_the_chosen_rows(gen):
    # The read ceiling beside the MoE rows must move exactly the rows' bytes: its int32 sums
    # (wrapping) must total the rows' sum mod 2**32, for rows that are no whole number of
    # chunks, repeated and out of order, in every grid shape best_read_seconds tries.
    pytest.importorskip("triton")
    from zeroinfer.testing import stream_read

    x = torch.randint(0, 256, (9, 5, 2052), dtype=torch.uint8, generator=gen).cuda()
    rows = torch.randperm(9, generator=gen)[:5].to(torch.int32)
    rows = torch.cat([rows, rows[:1]]).cuda()
    want = int(x.view(9, -1).view(torch.int32)[rows.long()].sum()) % 2**32
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for per_sm in (4, 16):
        for block in (1024, 4096):
            fn, out = stream_read.reader(x, rows, programs=per_sm * sms, block=block)
            out.fill_(-7)  # poison: a program that stored nothing would change the total
            fn()
            assert int(out.long().sum()) % 2**32 == want, (per_sm, block)
    t = stream_read.best_read_seconds(x, rows, lambda f: bench.time_kernels(f, reps=5))
    assert t is not None and t > 0


def test_stream_read_names_bad_arguments():
    from zeroinfer.testing import stream_read

    if not stream_read.available():
        pytest.skip("needs Triton")
    x = torch.empty(4, 6, dtype=torch.uint8)
    with pytest.raises(ValueError, match="whole number of int32 words"):
        stream_read.reader(x, torch.zeros(1, dtype=torch.int32), programs=1, block=16)
    with pytest.raises(ValueError, match="1-D int32"):
        stream_read.reader(torch.empty(4, 8, dtype=torch.uint8), torch.zeros(1), programs=1,
                           block=16)


def test_launch_counter_sees_ops_and_kernel_calls_and_restores_C(gen):
    """probe_decode_ops' LaunchCounter: a computing aten op and a call into _C count at their
    zeroinfer site, views and allocations do not, and _C's entry points are themselves again
    afterwards."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from probe_decode_ops import LaunchCounter

    from zeroinfer import _C
    from zeroinfer.model.norm import rms_norm

    before = _C.rms_norm
    x = torch.randn(3, 64, generator=gen)
    w = torch.rand(64, generator=gen) + 0.5
    counter = LaunchCounter()
    with counter:
        rms_norm(x, w, 1e-6)  # one _C call; its output an allocation, x's views free
    assert _C.rms_norm is before
    assert counter.by_site == {"ops/rms_norm.py rms_norm": 1}


@pytest.mark.parametrize("probe, args, slots",
                         [("probe_mla_stamps", (), ["ZS_PUT0(2,", "ZS_PUT0(14,"]),
                          ("probe_moe_stamps", (False,), ["ZS_PUT(1,", "ZS_PUT(15,"])])
def test_stamp_probes_still_find_their_anchors(tmp_path, monkeypatch, probe, args, slots):
    """The clock-stamp probes patch the CUDA sources at fixed anchors and exit when one moved:
    caught here, on the CPU, rather than inside a device call. The stamped copy carries the
    stamps and the printing kernel (nvcc compiles it where the probe is built)."""
    root = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(root)
    monkeypatch.syspath_prepend(str(root / "bench"))
    out = tmp_path / "stamped.cu"
    __import__(probe).make(str(out), *args)
    text = out.read_text()
    assert "__global__ void zs_print" in text
    for slot in slots:
        assert slot in text, slot


# ------------------------------------------------------------------------------------------------
# The benchmarks' byte / FLOP / floor formulas against independent counts made by hand from the
# shapes (Issue 5: sparse MLA; Issue 6: MXFP4 grouped GEMM, dispatch / combine).

_BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench_dir(monkeypatch):
    monkeypatch.syspath_prepend(str(_BENCH))


def test_roofline_row_floor_by_hand():
    # 1 MB and 2 GFLOP against 2 TB/s and 100 TFLOP/s: 0.5 us of bytes, 20 us of FLOPs, so the
    # floor is 20 us; at 40 us that is half of it. Rates: 1e6 B / 40e-6 s = 25 GB/s, 2e9 / 40e-6
    # = 50 TFLOP/s.
    row = bench.roofline_row(seconds=40e-6, bytes_moved=1e6, flops=2e9,
                             ceilings={"hbm_bytes_per_s": 2e12, "bf16_flops_per_s": 1e14},
                             kernel_seconds=25e-6)
    assert row["time_us"] == pytest.approx(40.0)
    assert row["floor_us"] == pytest.approx(20.0)
    assert row["fraction_of_floor"] == pytest.approx(0.5)
    assert row["kernel_fraction_of_floor"] == pytest.approx(0.8)
    assert row["gbps"] == pytest.approx(25.0)
    assert row["tflops"] == pytest.approx(50.0)
    # memory-bound: 8 MB at 2 TB/s = 4 us > 1 GFLOP at 1e15 = 1 us
    row = bench.roofline_row(seconds=8e-6, bytes_moved=8e6, flops=1e9,
                             ceilings={"hbm_bytes_per_s": 2e12, "bf16_flops_per_s": 1e15})
    assert row["floor_us"] == pytest.approx(4.0)
    assert row["fraction_of_floor"] == pytest.approx(0.5)
    assert bench.roofline_row(seconds=1.0, bytes_moved=1, flops=1, ceilings=None,
                              kernel_seconds=1.0)["kernel_fraction_of_floor"] is None


def test_sparse_mla_row_size_is_the_v4_fp8_layout(bench_dir):
    from bench_sparse_mla import bytes_and_flops

    from zeroinfer.quant import kv_fp8

    # V4: 448 e4m3 NoPE bytes + 64 bf16 RoPE values + 7 UE8M0 scale bytes and 1 pad = 584
    fp8_row = 448 + 64 * 2 + 8
    assert fp8_row == kv_fp8.BYTES_PER_TOKEN == 584
    one, _ = bytes_and_flops(1, 1, 1, "fp8", distinct=1)
    two, _ = bytes_and_flops(1, 1, 1, "fp8", distinct=2)
    assert two - one == fp8_row
    one, _ = bytes_and_flops(1, 1, 1, "bf16", distinct=1)
    two, _ = bytes_and_flops(1, 1, 1, "bf16", distinct=2)
    assert two - one == 512 * 2
    cache = kv_fp8.quantize_kv_fp8(torch.randn(2, 64, 512))
    assert cache.shape[1] == 64 * fp8_row  # what a cached token really takes


@pytest.mark.parametrize("fmt, row", [("fp8", 584), ("bf16", 1024)])
def test_sparse_mla_bytes_and_flops_by_hand(bench_dir, fmt, row):
    from bench_sparse_mla import bytes_and_flops

    # one decode token, 64 heads, 128 window + 512 compressed keys, all distinct
    T, H, K, D = 1, 64, 640, 512
    nbytes, flops = bytes_and_flops(T, H, K, fmt, distinct=640)
    q_in, out = T * H * D * 2, T * H * D * 2  # bf16 queries read, bf16 outputs written
    lse = T * H * 4                            # float32 LSE written
    idx = T * (128 + 512) * 4                  # int32 window + compressed indices read
    assert nbytes == 640 * row + q_in + out + lse + idx
    qk, pv = 2 * H * K * D, 2 * H * K * D      # S = q K^T and O = P V, every listed key
    assert flops == T * (qk + pv)
    if fmt == "fp8":
        assert nbytes == 507648  # bench/results/*/sparse_mla.json, decode b = 1 s_q = 1
    # without `distinct` (the CPU rows): every token's K rows
    assert bytes_and_flops(3, H, K, fmt)[0] == 3 * K * row + 3 * (q_in + out + lse + idx)


def _rows_read(a):
    """(cache, slot) pairs the lists name, by a plain set (any kernel reads at least these)."""
    rows = {("main", int(s)) for s in a["indices"].flatten() if s >= 0}
    rows |= {("extra", int(s)) for s in a["extra_indices"].flatten() if s >= 0}
    return rows


@pytest.mark.parametrize("requests, s_q", [(1, 1), (3, 1), (1, 2), (3, 2)])
def test_sparse_mla_decode_distinct_rows_by_hand(bench_dir, requests, s_q):
    from bench_sparse_mla import TOPK, WINDOW, make_inputs

    gen = torch.Generator().manual_seed(requests * 10 + s_q)
    a, distinct = make_inputs(requests * s_q, 16, "bf16", "cpu", gen, s_q=s_q)
    # A request's s_q tokens: windows shifted by one slot (128 + s_q - 1 distinct main rows),
    # the same 512 compressed picks; requests share nothing.
    per_request = (WINDOW + s_q - 1) + TOPK
    assert distinct == requests * per_request == len(_rows_read(a))
    assert a["indices"].shape == (requests * s_q, WINDOW)
    assert a["extra_indices"].shape == (requests * s_q, TOPK)
    for t in range(requests * s_q):  # every listed key is a distinct valid row of its token
        assert a["indices"][t].unique().numel() == WINDOW
        assert a["extra_indices"][t].unique().numel() == TOPK


def test_sparse_mla_prefill_distinct_rows_by_hand(bench_dir):
    from bench_sparse_mla import EXTRA_PER_REQ, WINDOW, make_inputs

    T = 256
    gen = torch.Generator().manual_seed(5)
    a, distinct = make_inputs(T, 16, "fp8", "cpu", gen, prefill=True)
    # token t sees main slots t+1 .. t+128: slots 1 .. T+127 in all
    assert {int(s) for s in a["indices"].flatten()} == set(range(1, T + WINDOW))
    extra = {int(s) for s in a["extra_indices"].flatten()}
    assert extra <= set(range(EXTRA_PER_REQ))
    assert distinct == (T + WINDOW - 1) + len(extra) == len(_rows_read(a))


def test_moe_gemm_weight_bytes_are_4_25_bits_a_weight(bench_dir):
    from bench_moe_gemm import HIDDEN, INTER, make_weights

    from zeroinfer.ops.moe_gemm import mxfp4_prepack

    # bench_moe_gemm's weight_bytes = active * n_pad * k_pad * 17 // 32 and its read reference
    # reads an expert's row of the packed data: both must be e2m1 (4 bits) + one UE8M0 byte a 32
    # (0.25 bits) of the checkpoint's N x K, for the V4-Flash shapes (no padding rows).
    gen = torch.Generator().manual_seed(0)
    for n, k, fuse in ((2 * INTER, HIDDEN, True), (HIDDEN, INTER, False)):
        w, s = make_weights(1, n, k, gen)
        assert w.numel() + s.numel() == n * k * 4.25 / 8
        for act in (torch.bfloat16, torch.float8_e4m3fn):
            pw = mxfp4_prepack(w, s, fuse_swiglu=fuse, act_dtype=act)
            assert pw.n_pad * pw.k_pad * 17 // 32 == n * k * 4.25 / 8 == pw.data[0].numel()


def test_moe_gemm_routing_active_experts_by_hand(bench_dir):
    from bench_moe_gemm import EXPERTS, TOPK, routing_offsets

    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 8, 32):
        off = routing_offsets(tokens, EXPERTS, True, gen)  # skewed: experts 0..5, every token
        counts = (off[1:] - off[:-1]).tolist()
        assert counts == [tokens] * TOPK + [0] * (EXPERTS - TOPK)
    # uniform: the bench's own draw (torch.rand(...).topk) replayed; 6 distinct experts a token
    for tokens in (1, 8, 32):
        g1, g2 = torch.Generator().manual_seed(tokens), torch.Generator().manual_seed(tokens)
        off = routing_offsets(tokens, EXPERTS, False, g1)
        ids = torch.rand(tokens, EXPERTS, generator=g2).topk(TOPK, dim=1).indices
        assert all(len(set(r)) == TOPK for r in ids.tolist())
        want = {e for r in ids.tolist() for e in r}
        counts = off[1:] - off[:-1]
        assert {e for e in range(EXPERTS) if counts[e] > 0} == want
        assert int(off[-1]) == tokens * TOPK


def test_moe_gemm_flops_convention():
    # gate_up is one GEMM of N = 2 * intermediate (gate and up rows): 2 * M * (2 * 2048) * 4096,
    # down 2 * M * 4096 * 2048; what bench/results/*/moe_gemm.json hold at 6 rows (1 token)
    m = 6
    assert 2.0 * m * (2 * 2048) * 4096 == 201326592.0
    assert 2.0 * m * 4096 * 2048 == 100663296.0


def test_dispatch_combine_bytes_by_hand(bench_dir):
    from bench_dispatch_combine import combine_bytes, dispatch_bytes

    from zeroinfer.ops.dispatch_combine import moe_dispatch_capacity

    T, D, k, E, tile = 1, 4096, 6, 256, 64
    cap = moe_dispatch_capacity(T, k, E, tile)
    assert cap == T * k + min(E, T * k) * (tile - 1) == 384
    # dispatch: x read once (bf16), int32 ids read, T*k bf16 rows written, int32 token_row
    # [T, k], row_token [capacity], counts [E] and offsets [E + 1] written
    want = T * D * 2 + T * k * 4 + T * k * D * 2 + T * k * 4 + cap * 4 + E * 4 + (E + 1) * 4
    assert dispatch_bytes(T, D, k, E, 2, 4, cap) == want == 60980
    # combine: T*k bf16 rows, int32 token_row and float32 weights read, T bf16 rows written
    assert combine_bytes(T, D, k, 2, 2, 4) == T * k * D * 2 + T * k * 4 + T * k * 4 + T * D * 2
    assert combine_bytes(T, D, k, 2, 2, 4) == 57392


def test_write_results_records_commit_machine_and_folder(tmp_path, monkeypatch):
    import json
    import os
    import subprocess

    monkeypatch.delenv("ZEROINFER_COMMIT", raising=False)
    path = bench.write_results("probe", [{"x": 1}], device="cpu", out_dir=tmp_path)
    doc = json.loads(path.read_text())
    machine = f"cpu-{os.cpu_count()}core"
    assert path == tmp_path / machine / "probe.json"
    assert doc["machine"] == machine and doc["rows"] == [{"x": 1}]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=bench.REPO, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert doc["commit"] in (head, head + "-dirty")
    monkeypatch.setenv("ZEROINFER_COMMIT", "abc1234")
    assert bench.git_commit() == "abc1234"


def test_commit_is_dirty_for_source_changes_not_result_files(tmp_path, monkeypatch):
    """A sweep writes one benchmark's JSON before the next reads the commit: a changed file under
    bench/results/ must not mark it -dirty (four cpu-2core files said -dirty for that alone),
    a changed source file must."""
    def git(*a):
        return subprocess.run(["git", *a], cwd=tmp_path, capture_output=True, text=True,
                              check=True).stdout.strip()

    (tmp_path / "bench" / "results" / "cpu").mkdir(parents=True)
    (tmp_path / "src.py").write_text("x = 1\n")
    (tmp_path / "bench" / "results" / "cpu" / "a.json").write_text("{}\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    head = git("rev-parse", "HEAD")
    monkeypatch.delenv("ZEROINFER_COMMIT", raising=False)
    monkeypatch.setattr(bench, "REPO", tmp_path)
    assert bench.git_commit() == head
    (tmp_path / "bench" / "results" / "cpu" / "a.json").write_text('{"rows": []}\n')
    assert bench.git_commit() == head
    (tmp_path / "src.py").write_text("x = 2\n")
    assert bench.git_commit() == head + "-dirty"


def test_speculative_bench_counts_only_the_timed_rounds(bench_dir):
    """bench_speculative's tokens_per_round / fraction_of_ideal / host us per round divide by
    the rounds of the timed region (after the prefill round, which the wall time leaves out).
    By hand: plain decoding of L tokens makes one token a decode round, so L - 1 rounds; a
    drafter that is always right with d drafts makes d + 1 a round, so ceil((L - 1) / (d + 1))."""
    from bench_speculative import _pass

    from zeroinfer.engine.speculative import SpeculativeConfig
    from zeroinfer.model import load
    from zeroinfer.sampling_params import SamplingParams

    model = load("dummy", dtype=torch.float32, device="cpu", mtp=True)
    L, d = 7, 2
    params = SamplingParams(max_tokens=L, ignore_eos=True, temperature=0.0)
    prompts = [[5, 6, 7, 8, 9, 10]]
    _, plain, eng = _pass(model, prompts, params, None, "plain", None, 1)
    eng.close()
    assert eng.timed_rounds == L - 1
    _, out, eng = _pass(model, prompts, params, SpeculativeConfig(d, method="ngram"),
                        "oracle@1.0", plain, 1)
    eng.close()
    assert out == plain
    assert eng.timed_rounds == -(-(L - 1) // (d + 1))
