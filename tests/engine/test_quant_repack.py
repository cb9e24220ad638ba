"""Weights of every block format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) repacked at load for int8
activations (csrc/quant_repack.h): groups of 16 weight rows interleaved, multiplied by the AVX512-VNNI build's
tiles and by the AVX2 build's. The product is the dequantized weight's in float64 within the int8 path's bound
(x's rounding, half a level a value), and the file layout's int8 tiles' up to float32 sums (both sum the same int8
products exactly); odd shapes: N not a multiple of the group, K not a multiple of 64 or 256, more rows of x than a
tile takes."""
from __future__ import annotations

import logging
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sluice.engine.cpu import build as kernel_build
from sluice.engine.cpu import quant as cpu_quant
from sluice.engine.cpu.quant import QuantMatmul, RepackedWeight
from sluice.engine.quant import BY_NAME, Q8_C, QuantizedWeight, channel_int8
from tests.engine import test_quant
from tests.engine.test_quant import ISAS, random_weight, reference

isa = test_quant.isa  # (the fixture: the kernels built for one instruction set)

REPACKED = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]
PACKED = 0x100  # (csrc/quant_repack.h's QR_PACKED, in a part's type)
GROUP = 128  # (csrc/quant_channel.h's QC_GROUP: values of x a scale, per-channel weights)


def int8_bound(weight, x: torch.Tensor) -> torch.Tensor:
    """Half a level of each block of 32 of x a value, times the weight's magnitude, plus float32 sums' room."""
    m, k = x.shape
    w = weight.dequantize().double()
    level = x.view(m, -1, 32).abs().amax(-1, keepdim=True).expand(-1, -1, 32).reshape(m, k).double() / 127
    return (level / 2) @ w.abs().T + 1e-5 * (x.abs().double() @ w.abs().T) + 1e-6


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("name", REPACKED)
@pytest.mark.parametrize("shape", [(1, 17, 96), (9, 33, 160)])
def test_repacked_tiles_give_the_products_bound_and_the_file_layouts_sums(isa, name, shape):
    m, n, k = shape
    k = k // 32 * 256 if name.endswith("_K") else k  # (super-blocks of 256: 3 and 5 of them)
    weight = random_weight(name, n, k, seed=n)
    x, bias = torch.randn(m, k), torch.randn(n)
    packed = QuantMatmul.build(weight, bias, int8=True)
    on_file = QuantMatmul.build(weight, bias, int8=True, repack=False)
    assert packed.spec[0].type == weight.qtype.ggml | PACKED and on_file.spec[0].type == weight.qtype.ggml
    got = packed(x).double()
    assert ((got - reference(weight, x, bias)).abs() <= int8_bound(weight, x)).all()
    scale = x.abs().double() @ weight.dequantize().abs().double().T
    assert ((got - on_file(x).double()).abs() <= 1e-5 * scale + 1e-6).all()


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_a_repacked_weight_takes_the_files_bytes_a_row(isa, n=21):
    """Groups of 16 rows, the last one's missing rows zero: the file's bytes rearranged, no float copy; a Q4_K /
    Q5_K row 148 / 180 bytes a super-block for the file's 144 / 176 (their 6-bit scales and mins as bytes), a
    Q6_K row the file's 210."""
    weight = random_weight("Q4_1", n, 64)
    packed = QuantMatmul.build(weight, None, int8=True).packed[0]
    assert packed.shape == ((n + 15) // 16 * 16, weight.data.shape[1])
    padding = torch.zeros(packed.numel() - weight.data.numel(), dtype=torch.uint8)
    assert torch.equal(packed.flatten().bincount(minlength=256),
                       torch.cat([weight.data.flatten(), padding]).bincount(minlength=256))
    for name, row_bytes in {"Q4_K": 148, "Q5_K": 180, "Q6_K": 210}.items():
        kernel = QuantMatmul.build(random_weight(name, n, 512), None, int8=True)
        assert kernel.packed[0].shape == ((n + 15) // 16 * 16, 2 * row_bytes)
        assert kernel.spec[0].row_bytes == 2 * row_bytes


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_repacked_parts_of_different_types_run_as_one_stacked_weight(isa, m=11):
    """A Q4_K_M file's stacked projection (q, k, v of different types), repacked, in one call."""
    parts = (random_weight("Q5_K", 7, 256), random_weight("Q4_0", 18, 256, seed=1), random_weight("Q6_K", 3, 256))
    x, bias = torch.randn(m, 256), torch.randn(28)
    kernel = QuantMatmul.build(parts, bias, int8=True)
    assert [bool(p.type & PACKED) for p in kernel.spec] == [True, True, True]
    want = torch.cat([reference(p, x, None) for p in parts], 1) + bias.double()
    bound = torch.cat([int8_bound(p, x) for p in parts], 1)
    assert ((kernel(x).double() - want).abs() <= bound).all()


def test_unset_activations_are_int8_with_every_block_format_repacked_and_logged(monkeypatch, caplog):
    """The default: int8 for every block format, repacked (faster than float32 weights and than the file
    layout's tiles, bench/RESULTS.md); SLUICE_QUANT_ACTIVATIONS=float keeps the float path."""
    monkeypatch.delenv("SLUICE_QUANT_ACTIVATIONS", raising=False)
    kernel_build.clear()
    with caplog.at_level(logging.INFO, logger="sluice.engine"):
        if cpu_quant.library() is None:
            pytest.skip("no quantized kernel builds here")
    assert "int8 activations (every block format repacked at load)" in caplog.text
    for name in REPACKED:
        kernel = QuantMatmul.build(random_weight(name, 16, 256))
        assert kernel.int8 and kernel.spec[0].type == kernel.parts[0].qtype.ggml | PACKED
    monkeypatch.setenv("SLUICE_QUANT_ACTIVATIONS", "float")
    assert not QuantMatmul.build(random_weight("Q4_0", 16, 256)).int8


def test_a_file_mapped_weight_gives_its_pages_back_once_repacked(tmp_path):
    """A GGUF file's weight lies in a read-only map of the file: once repacked, its pages leave this process's
    resident set (the kernel reads the copy), and its bytes still read the same (from the page cache)."""
    if cpu_quant.library() is None:
        pytest.skip("no quantized kernel builds here")
    weight = random_weight("Q4_0", 4096, 512)  # (4096 rows of 288 bytes: 1.2 MB)
    path = tmp_path / "weight.bin"
    weight.data.numpy().tofile(path)
    with warnings.catch_warnings():  # (a read-only map: nothing writes to it)
        warnings.simplefilter("ignore", UserWarning)
        data = torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="r", shape=tuple(weight.data.shape)))
    mapped = QuantizedWeight(data, weight.qtype, weight.shape, mapped=True)
    assert torch.equal(mapped.data, weight.data) and resident_kb(path) >= 1024  # (every page read once)
    kernel = QuantMatmul.build(mapped, None, int8=True)
    assert resident_kb(path) <= 8  # (at most the pages the weight's first and last bytes share)
    x = torch.randn(3, 512)
    assert torch.equal(kernel(x), QuantMatmul.build(weight, None, int8=True)(x))
    assert torch.equal(mapped.data, weight.data)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from([*REPACKED, "Q8_C"]), n=st.integers(1, 40), blocks=st.integers(1, 3),
       seed=st.integers(0, 2**31))
def test_a_weight_read_into_memory_is_held_only_repacked_and_unpacks_to_its_bytes(isa, name, n, blocks, seed):
    """Once its int8 kernel is built, a weight in memory (not a file's map) is held as the repacked copy alone
    (`RepackedWeight`: the loaded bytes go), and reading its bytes unpacks them exactly: any bytes at all (every
    bit of a row is in its repacked form; Q4_K / Q5_K's 6-bit scales and mins encoded back into their 12), N not
    whole groups of 16. A float-activation kernel or one on the file's layout built from it runs those bytes."""
    qtype = Q8_C if name == "Q8_C" else BY_NAME[name]
    k = blocks * (256 if name.endswith("_K") else 32)
    data = torch.randint(0, 256, (n, qtype.row_head + k // qtype.block_size * qtype.block_bytes), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    kernel = QuantMatmul.build(QuantizedWeight(data.clone(), qtype, (n, k)), None, int8=True)
    (held,) = kernel.parts
    assert isinstance(held, RepackedWeight) and held.packed is kernel.packed[0] and held.nbytes == data.numel()
    assert torch.equal(held.data, data)
    if name != "Q8_C":  # (per-channel weights under float activations: Q8_0 blocks of them, tested above)
        x, stored = torch.randn(2, k), QuantizedWeight(data, qtype, (n, k))
        for int8, repack in ((False, True), (True, False)):
            rebuilt = QuantMatmul.build(held, None, int8=int8, repack=repack)
            assert not isinstance(rebuilt.parts[0], RepackedWeight) and torch.equal(rebuilt.parts[0].data, data)
            torch.testing.assert_close(rebuilt(x), QuantMatmul.build(stored, None, int8=int8, repack=repack)(x),
                                       rtol=0, atol=0, equal_nan=True)  # (random bytes: some scales NaN)


def resident_kb(path: Path) -> int:
    """This process's resident kB in its maps of `path` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):
            inside = line.rstrip().endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def channel_weight(n: int, k: int, seed: int = 0) -> QuantizedWeight:
    """A per-channel int8 weight (compressed-tensors' W8A8 layout, engine/quant.py's Q8_C): int8 values, the
    extremes among them, and a float32 scale a row."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    q[0, :7] = torch.tensor([-128, 127, -128, 127, 0, -1, 1], dtype=torch.int8)
    return channel_int8(q, torch.rand(n, generator=gen) * 0.02 + 1e-4)


@pytest.mark.parametrize("isa", ISAS, indirect=True)
@pytest.mark.parametrize("shape", [(1, 17, 96), (9, 33, 160), (13, 16, 32), (3, 40, 4096)])
def test_per_channel_tiles_are_the_int8_product_per_group_of_x(isa, shape):
    """csrc/quant_channel.h: each row of x quantized per group of 128 values (d = max |x| / 127, round to nearest
    even), each group's int8 products summed exactly, times its d, the sum times the weight row's scale once:
    the float64 product of those integers within float32's rounding of the result; more rows of x than a tile
    takes, N not whole groups of weight rows, K not whole groups of x (96, 160: one short group) nor a multiple
    of 64, a row of zeros."""
    m, n, k = shape
    weight = channel_weight(n, k, seed=n)
    x, bias = torch.randn(m, k) * 3, torch.randn(n)
    x[-1] = 0 if m > 1 else x[-1]
    kernel = QuantMatmul.build(weight, bias, int8=True)
    assert kernel.spec[0].type == weight.qtype.ggml | PACKED and kernel.packed[0].shape == ((n + 15) // 16 * 16, k + 4)
    q, scale = weight.data[:, 4:].view(torch.int8).double(), weight.data[:, :4].contiguous().view(torch.float32)
    want, size = torch.zeros(m, n, dtype=torch.float64), torch.zeros(m, n, dtype=torch.float64)
    for start in range(0, k, GROUP):  # (x's groups of 128 values, the last one shorter)
        g = x[:, start:start + GROUP]
        amax = g.abs().amax(1, keepdim=True)
        xq = torch.round(g * torch.where(amax > 0, 127 / amax, 0))  # (as the kernel: x times 127 / max, float32)
        part = (xq.double() @ q[:, start:start + GROUP].T) * (amax.double() / 127)
        want, size = want + part, size + part.abs()
    want = want * scale.double().reshape(-1) + bias.double()
    got = kernel(x).double()  # (the groups' float32 sums: within a few roundings of their magnitudes)
    assert ((got - want).abs() <= 1e-6 * size * scale.double().reshape(-1) + 1e-5).all()


@pytest.mark.parametrize("isa", ISAS, indirect=True)
def test_per_channel_weights_under_float_activations_or_beside_another_kind_run_as_q8_0(isa):
    """Float activations (the float path's tiles), or a stack beside another kind: Q8_0 blocks of the same
    values (the scales float16's, within 2^-11), the weight-only product."""
    weight = channel_weight(24, 256)
    x = torch.randn(5, 256)
    floats = QuantMatmul.build(weight, None, int8=False)
    assert [p.qtype.name for p in floats.parts] == ["Q8_0"]
    assert ((floats.parts[0].dequantize() - weight.dequantize()).abs() <= weight.dequantize().abs() * 2**-11).all()
    assert torch.allclose(floats(x), x @ floats.parts[0].dequantize().T, rtol=1e-4, atol=1e-4)
    mixed = QuantMatmul.build((weight, random_weight("Q4_0", 16, 256)), None, int8=True)
    assert [p.qtype.name for p in mixed.parts] == ["Q8_0", "Q4_0"]
