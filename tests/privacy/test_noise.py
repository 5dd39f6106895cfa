"""Secret DP randomness (pipeline/privacy/noise.py): the ChaCha20 CSPRNG, its Opacus dispatcher, the test hook."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from opacus.optimizers import optimizer as opacus_optimizer

from pipeline.privacy import noise


def test_chacha_gaussians_have_mean_0_and_std_1():
    """Box–Muller on ChaCha20 uniforms: 200k draws, mean and std within a few standard errors."""
    z = noise.ChaCha20Normal(b"k" * 32).normal(200_001)
    assert z.dtype == torch.float64 and z.shape == (200_001,)
    assert abs(z.mean().item()) < 0.01 and abs(z.std().item() - 1) < 0.01
    assert abs((z.abs() < 1).double().mean().item() - 0.6827) < 0.005  # the Gaussian's shape, not just moments


def test_chacha_state_resumes_the_exact_stream():
    """(key, draws) is the whole state: restored, the generator continues where it stopped."""
    a = noise.ChaCha20Normal(b"s" * 32)
    a.normal(10)
    state = a.state_dict()
    expected = a.normal(5)
    b = noise.ChaCha20Normal(b"x" * 32)
    b.load_state_dict(state)
    assert torch.equal(b.normal(5), expected)
    assert not torch.equal(a.normal(5), expected)  # and it never repeats a draw


def test_secure_gaussian_has_the_requested_std():
    """The sum of 4 draws, halved (Opacus' secure mode): variance std² again."""
    x = noise.secure_gaussian(noise.ChaCha20Normal(b"g" * 32), 3.0, (400, 250), dtype=torch.float32)
    assert x.shape == (400, 250) and x.dtype == torch.float32
    assert abs(x.std().item() - 3.0) < 0.05


def test_opacus_noise_dispatcher_handles_ours_and_leaves_torch_generators_alone():
    """Opacus' optimizers call _generate_noise: our generator gets ChaCha20 noise; a
    torch.Generator gets exactly what Opacus' original function gives."""
    ref = torch.zeros(3, 4, dtype=torch.float32)
    ours = opacus_optimizer._generate_noise(std=2.0, reference=ref, generator=noise.ChaCha20Normal(b"d" * 32))
    assert ours.shape == ref.shape and ours.dtype == ref.dtype and ours.abs().sum() > 0
    original = opacus_optimizer._generate_noise._opacus_original
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(opacus_optimizer._generate_noise(std=2.0, reference=ref, generator=g1),
                       original(std=2.0, reference=ref, generator=g2))


def test_generators_are_secret_unless_the_test_hook_is_set(monkeypatch):
    """Without the hook every generator is keyed anew from OS entropy; with it, fixed and labelled."""
    monkeypatch.delenv(noise.TEST_SEED_ENV, raising=False)
    for secure in (False, True):
        a, b = noise.generator("noise", secure=secure), noise.generator("noise", secure=secure)
        assert not torch.equal(noise.uniform(a, 8), noise.uniform(b, 8))
    assert "NOT private" not in noise.source(False) and noise.source(True).startswith("csprng")
    monkeypatch.setenv(noise.TEST_SEED_ENV, "11")
    a, b = noise.generator("noise", secure=True, rank=1), noise.generator("noise", secure=True, rank=1)
    assert torch.equal(noise.uniform(a, 8), noise.uniform(b, 8))
    other = noise.generator("poisson", secure=True, rank=1)  # another purpose: another stream
    assert not torch.equal(noise.uniform(other, 8), noise.uniform(noise.generator("noise", secure=True, rank=1), 8))
    assert noise.source(True).startswith("TEST HOOK")


@pytest.mark.parametrize("secure", [False, True])
def test_randbelow_covers_the_range(secure, monkeypatch):
    monkeypatch.setenv(noise.TEST_SEED_ENV, "0")
    g = noise.generator("user_pick", secure=secure)
    assert {noise.randbelow(g, 3) for _ in range(200)} == {0, 1, 2}


def test_mt19937_takes_every_secret_bit(monkeypatch):
    """The attack on `manual_seed`: it keeps a seed's low 32 bits, so two secrets differing only
    above them give one stream, and 2³² guesses recover any. `generator()` keys the whole
    624-word state: secrets differing in their last byte give different streams (from the
    624th word on: mt19937 reads its state in order)."""
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5 + 2**32)
    assert torch.equal(torch.randn(8, generator=a), torch.randn(8, generator=b))  # why manual_seed is not used
    key = bytearray(range(256)) * 9 + bytearray(range(192))  # 2,496 bytes
    other = key[:-1] + bytes([key[-1] ^ 1])
    draws = []
    for secret in (bytes(key), bytes(other)):
        monkeypatch.setattr(noise, "_secret_bytes", lambda n, purpose, rank=0, s=secret: s[:n])
        draws.append(torch.randn(1000, generator=noise.generator("noise", secure=False)))
    assert not torch.equal(*draws)


def test_keyed_mt19937_is_numpys_mt19937_on_the_same_words():
    """An independent reference: numpy's MT19937 with the same 624 words gives the same 32-bit
    outputs (torch's 64-bit draw is two of them, high word first)."""
    key = bytes(range(256)) * 9 + bytes(range(192))
    g = torch.Generator()
    noise.keyed_mt19937(g, key)
    ours = torch.empty(300, dtype=torch.int64).random_(generator=g).tolist()
    reference = np.random.MT19937(0)
    reference.state = {"bit_generator": "MT19937",
                       "state": {"key": np.frombuffer(key, dtype=np.uint32).copy(), "pos": noise.MT_WORDS}}
    raw = [int(reference.random_raw()) for _ in range(600)]
    assert ours == [(raw[2 * i] << 32 | raw[2 * i + 1]) & (2**63 - 1) for i in range(300)]
    with pytest.raises(ValueError, match="not all zero"):
        noise.keyed_mt19937(g, bytes(4 * noise.MT_WORDS))
    with pytest.raises(ValueError, match="2496 bytes"):
        noise.keyed_mt19937(g, key[:32])


def test_the_test_hook_fixes_the_mt19937_generators_too(monkeypatch):
    monkeypatch.setenv(noise.TEST_SEED_ENV, "3")
    a, b = noise.generator("noise", secure=False, rank=2), noise.generator("noise", secure=False, rank=2)
    assert torch.equal(torch.randn(8, generator=a), torch.randn(8, generator=b))
    assert not torch.equal(torch.randn(8, generator=noise.generator("poisson", secure=False, rank=2)),
                           torch.randn(8, generator=noise.generator("noise", secure=False, rank=2)))


@pytest.mark.parametrize("n", [5, 16, 100, 4096 * 3 + 5, 4096 * 3 + 15, 4096 * 3 + 16, 4096 * 4])
def test_noise_added_in_place_is_opacus_noise_bit_for_bit(n, monkeypatch):
    """bk adds the DP noise chunk by chunk into the clipped sum (add_gaussian_): the same values
    and the same generator state after as Opacus' `_generate_noise`, for sizes around the chunk
    (4,096 here) and its 16-value blocks, so every clipping mode draws the same noise."""
    monkeypatch.setattr(noise, "NOISE_CHUNK", 4096)
    gen = noise.generator("noise", secure=False)
    state = gen.get_state()
    base = torch.linspace(-1, 1, n)
    ours = noise.add_gaussian_(base.clone(), 2.0, gen)
    after = gen.get_state()
    gen.set_state(state)
    reference = base + opacus_optimizer._generate_noise(std=2.0, reference=base, generator=gen)
    assert torch.equal(ours, reference) and torch.equal(after, gen.get_state())
    assert not torch.equal(ours, base)
