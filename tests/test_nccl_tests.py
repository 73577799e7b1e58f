"""Reading and writing nccl-tests output, its sizes and bandwidth conventions."""

import pytest

from triosim.common.errors import InputError
from triosim.hardware import nccl_tests as T

NEW = """\
# nccl-tests version 2.14.1 nccl-headers=22105 nccl-library=22105
# Collective test starting: all_reduce_perf
# nThread 1 nGpus 1 minBytes 8 maxBytes 134217728 step: 2(factor) warmup iters: 5 iters: 20 agg iters: 1 validation: 1 graph: 0
#
# Using devices
#  Rank  0 Group  0 Pid  1234 on   host-a device  0 [0000:19:00] NVIDIA H100 80GB HBM3
#  Rank  1 Group  0 Pid  1235 on   host-a device  1 [0000:3b:00] NVIDIA H100 80GB HBM3
host-a:1234:1234 [0] NCCL INFO Bootstrap : Using eth0:10.0.0.1<0>
NCCL version 2.21.5+cuda12.4
#
#                                                              out-of-place                       in-place
#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong
#        (B)    (elements)                               (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
           8             2     float     sum      -1    13.67    0.00    0.00      0    13.03    0.00    0.00      0
     1048576        262144     float     sum      -1    27.37   38.31   38.31      0    26.93   38.94   38.94      0
   134217728      33554432     float     sum      -1    586.4  228.88  228.88    N/A    586.0  229.05  229.05    N/A
# Out of bounds values : 0 OK
# Avg bus bandwidth    : 89.151
# Collective test concluded: all_reduce_perf
"""

# an older build: 'error' instead of '#wrong', no root column, MPI rank prefixes
OLD = """\
[1,0]<stdout>:# nThread 1 nGpus 1 minBytes 8 maxBytes 1048576 step: 2(factor) warmup iters: 5 iters: 20 validation: 1
[1,0]<stdout>:#
[1,0]<stdout>:#                                                     out-of-place                       in-place
[1,0]<stdout>:#       size         count    type   redop     time   algbw   busbw  error     time   algbw   busbw  error
[1,0]<stdout>:#        (B)    (elements)                     (us)  (GB/s)  (GB/s)            (us)  (GB/s)  (GB/s)
[1,0]<stdout>:        1024           256   float     sum    20.35    0.05    0.09  2e-07    20.01    0.05    0.09  2e-07
[1,0]<stdout>:     1048576        262144   float     sum    37.33   28.09   49.15  4e-07    37.01   28.33   49.58  4e-07
"""

SLURM = "\n".join("0: " + line for line in NEW.splitlines())


def test_parses_the_current_layout():
    [t] = T.parse(NEW)
    assert t.op == "all_reduce" and t.ranks == 2 and len(t.rows) == 3
    r = t.rows[1]
    assert (r.size, r.count, r.dtype, r.redop, r.root) == (1048576, 262144, "float", "sum", -1)
    assert r.time == pytest.approx(27.37e-6) and r.time_inplace == pytest.approx(26.93e-6)
    assert (r.algbw, r.busbw, r.wrong) == (38.31, 38.31, "0")
    assert t.rows[2].wrong == "N/A"


def test_parses_old_layout_without_root_with_error_column_and_mpi_prefixes():
    [t] = T.parse(OLD, op="all_reduce")
    assert [r.size for r in t.rows] == [1024, 1048576]
    assert t.rows[1].root is None and t.rows[1].wrong == "4e-07"
    assert t.rows[1].time == pytest.approx(37.33e-6) and t.rows[1].busbw == 49.15
    assert t.ranks == 8  # no Rank lines: from busbw / algbw = 2(n-1)/n


def test_strips_slurm_prefixes_and_reads_several_tables():
    [t] = T.parse(SLURM)
    assert len(t.rows) == 3 and t.ranks == 2
    two = T.parse(NEW + NEW.replace("all_reduce_perf", "all_gather_perf"))
    assert [x.op for x in two] == ["all_reduce", "all_gather"]


def test_size_arguments_as_nccl_tests_reads_them():
    assert T.parse_size("1G") == 2**30 and T.parse_size("64k") == 65536
    assert T.parse_size("8") == 8 and T.parse_size("1.5M") == 3 * 2**19
    with pytest.raises(InputError):
        T.parse_size("1GB")
    s = T.sizes(8, T.parse_size("1G"), 2)
    assert s[0] == 8 and s[-1] == 2**30 and len(s) == 28
    assert T.sizes(1000, 4000, 1, 1000) == [1000, 2000, 3000, 4000]


@pytest.mark.parametrize(
    "op,size,n,nbytes,count",
    [
        ("all_reduce", 1000, 8, 1000, 250),
        ("all_gather", 1000, 8, 896, 28),  # per-rank count rounded down to 4 floats (16 B)
        ("reduce_scatter", 2**20, 16, 2**20, 16384),
        ("alltoall", 1000, 8, 896, 28),
        ("broadcast", 1000, 8, 1000, 250),
    ],
)
def test_byte_counts(op, size, n, nbytes, count):
    assert T.byte_count(op, size, n) == (nbytes, count)


def test_busbw_factors():
    assert T.busbw_factor("all_reduce", 8) == pytest.approx(14 / 8)
    assert T.busbw_factor("all_gather", 8) == pytest.approx(7 / 8)
    assert T.busbw_factor("broadcast", 8) == 1 and T.busbw_factor("sendrecv", 8) == 1


def test_printed_lines_read_back():
    line = T.row_line("all_reduce", 2**20, 2**18, "float", -1, 27.37e-6, 8)
    text = "\n".join(T.header_lines() + [line])
    [t] = T.parse(text, op="all_reduce")
    r = t.rows[0]
    assert r.time == pytest.approx(27.37e-6) and r.algbw == pytest.approx(38.31, abs=0.005)
    assert r.busbw == pytest.approx(38.31 * 14 / 8, abs=0.01) and t.ranks == 8
    assert line.split()[2:5] == ["float", "sum", "-1"]
    assert "N/A" in line
