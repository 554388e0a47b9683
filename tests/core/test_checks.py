"""The one rule of a consumer's tensor arguments (symmsync.checks.tensor_problem): an output that
shares bytes with a tensor the call reads is refused, by byte ranges worked out here by hand."""

import torch

from symmsync.checks import tensor_problem

WORDS = dict(device_index=-1, memory="the consumer's memory on cpu", no_grad="the call has")


def problem(out, **apart):
    return tensor_problem("out", out, apart=apart, **WORDS)


def test_an_out_over_bytes_the_call_reads_is_refused_by_name():
    whole = torch.zeros(64)
    assert problem(whole[8:24], a=whole[16:32]) == (
        "out shares memory with a (the call reads a while it writes out): give out memory of its own"
    )
    assert problem(whole[16:32], a=whole[8:24]) is not None  # either order
    assert problem(whole[8:24], a=torch.zeros(4), b=whole[23:24]).startswith("out shares memory with b")


def test_neighbouring_bytes_and_empty_tensors_are_apart():
    whole = torch.zeros(64)
    assert problem(whole[8:16], a=whole[16:24], b=whole[0:8]) is None  # [32, 64) against [64, 96) and [0, 32)
    assert problem(whole[8:16], a=whole[12:12]) is None  # no bytes
    assert problem(whole[8:16], a=torch.zeros(8)) is None  # another allocation


def test_a_strided_tensor_spans_from_its_first_element_to_its_last():
    w = torch.zeros(8, 8)
    t = w.t()  # a transpose: first element at w[0, 0], last at w[7, 7]
    assert problem(w[7, 6:8], b=t) is not None
    assert problem(torch.zeros(2), b=t) is None
    rows = w[:, :2]  # strided rows: bytes [0, 58 * 4) of w, first two columns of each row
    assert problem(w[7, 1:3], a=rows) is not None  # w[7, 1] is its last element
    assert problem(w[7, 2:4], a=rows) is None  # past its last element
