"""models/performance/main_grad_add.py: grouped ``main_grad += grad`` equals one add per parameter."""

import torch

from models.performance.main_grad_add import add_into_main_grads, plan_runs


def _layout(sizes_and_gaps, dtype=torch.float32):
    """A flat buffer and views into it: [(numel, gap_after), ...] -> (buffer, views)."""
    total = sum(n + gap for n, gap in sizes_and_gaps)
    buf = torch.randn(total, dtype=dtype)
    views, at = [], 0
    for n, gap in sizes_and_gaps:
        views.append(buf[at:at + n])
        at += n + gap
    return buf, views


def test_grouped_adds_equal_single_adds_bit_for_bit_and_leave_gaps_alone():
    torch.manual_seed(0)
    # four neighbours (one padded by 16), one past a gap too wide to bridge, one large
    buf, mains = _layout([(96, 0), (40, 16), (128, 0), (7, 1000), (33, 0), (1 << 20, 0)])
    shapes = [(96,), (4, 10), (128,), (7,), (3, 11), (1024, 1024)]
    mains = [m.view(s) for m, s in zip(mains, shapes)]
    order = [3, 0, 5, 2, 1, 4]  # callers hand them in any order
    mains = [mains[i] for i in order]
    grads = [torch.randn(m.shape, dtype=torch.bfloat16) for m in mains]

    expected = buf.clone()
    exp_views = [expected[m.storage_offset():m.storage_offset() + m.numel()].view(m.shape) for m in mains]
    for m, g in zip(exp_views, grads):
        m.add_(g)

    single, runs = plan_runs(mains, grads)
    # the run in address order; the 33-element view is 1000 past its neighbour, the large one alone
    assert [[mains[i].storage_offset() for i in r] for r in runs] == [[0, 96, 152, 280]]
    assert sorted(mains[i].storage_offset() for i in single) == [1287, 1320]
    add_into_main_grads(mains, grads)
    assert torch.equal(buf, expected)  # gap elements included: they were added zero


def test_runs_break_at_wide_gaps_dtypes_and_large_tensors():
    buf, mains = _layout([(10, 0), (10, 0), (10, 65), (10, 0), (2000, 0)])
    grads = [torch.ones(10, dtype=torch.bfloat16), torch.ones(10, dtype=torch.float16),
             torch.ones(10, dtype=torch.bfloat16), torch.ones(10, dtype=torch.bfloat16),
             torch.ones(2000, dtype=torch.bfloat16)]
    single, runs = plan_runs(mains, grads, small=1000)
    # 0 and 2 share a dtype and are 10 apart (within MAX_GAP); 3 is 65 past 2: a new run
    assert runs == [[0, 2]]
    assert single == [1, 3, 4]
    before = buf.clone()
    add_into_main_grads(mains, grads)
    for m, g, off in zip(mains, grads, (0, 10, 20, 95, 105)):
        assert torch.equal(m, before[off:off + m.numel()] + g.float())
    assert torch.equal(buf[30:95], before[30:95])  # the gap after view 2 was never touched
