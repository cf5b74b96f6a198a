"""The benchmark harness's kernel timing (zeroinfer.testing.bench.time_kernels): how CUPTI
records are cut into calls, on synthetic records, and one real measurement on the GPU."""

import random
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
