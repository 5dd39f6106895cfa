"""Secret DP randomness (pipeline/privacy/noise.py): the ChaCha20 CSPRNG, its Opacus dispatcher, the test hook."""

from __future__ import annotations

import os
import time

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


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000])
def test_chacha_uniforms_are_the_keystream_words_chunk_by_chunk(n, monkeypatch):
    """The uniforms, made a chunk of keystream at a time into a reused buffer (8 words here), are
    the top 53 bits of each 64-bit word of the whole keystream under nonce = draws, from one
    plain `update` call (what they were before chunking), and the next draw takes the next nonce."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    monkeypatch.setattr(noise.ChaCha20Normal, "KEYSTREAM_CHUNK", 8)
    key = bytes(range(32))
    gen = noise.ChaCha20Normal(key, draws=5)
    for draw in (5, 6):
        nonce = b"\0" * 4 + draw.to_bytes(12, "little")
        stream = Cipher(algorithms.ChaCha20(key, nonce), mode=None).encryptor().update(bytes(8 * n))
        words = np.frombuffer(stream, dtype=np.uint64) >> np.uint64(11)
        assert torch.equal(gen.uniform(n), torch.from_numpy((words.astype(np.float64) + 0.5) * 2.0**-53))
    assert gen.draws == 7


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
    torch.Generator gets exactly what Opacus' original function gives for a draw under
    LANE_MIN values, other dtypes and std 0, and the lanes' values (reference_gaussian) for a
    large fp32 draw on a CPU."""
    ref = torch.zeros(3, 4, dtype=torch.float32)
    ours = opacus_optimizer._generate_noise(std=2.0, reference=ref, generator=noise.ChaCha20Normal(b"d" * 32))
    assert ours.shape == ref.shape and ours.dtype == ref.dtype and ours.abs().sum() > 0
    original = opacus_optimizer._generate_noise._opacus_original
    large = torch.zeros(noise.LANE_MIN + 3, dtype=torch.float32)
    for reference, std in ((ref, 2.0), (large.double(), 2.0), (large.bfloat16(), 2.0), (large, 0.0)):
        g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
        assert torch.equal(opacus_optimizer._generate_noise(std=std, reference=reference, generator=g1),
                           original(std=std, reference=reference, generator=g2))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    drawn = opacus_optimizer._generate_noise(std=2.0, reference=large, generator=g1)
    assert torch.equal(drawn, noise.reference_gaussian(large.numel(), 2.0, g2))
    assert torch.equal(g1.get_state(), g2.get_state())


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


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("n", [5, 16, 100, 4096 * 3 + 5, 4096 * 3 + 15, 4096 * 3 + 16, 4096 * 4, 4096 * 9 + 7])
def test_noise_added_in_place_is_the_lanes_noise_bit_for_bit(n, threads, monkeypatch):
    """bk adds the DP noise chunk by chunk into the clipped sum (add_gaussian_), its lanes on
    parallel threads: the same values and the same generator state after as the plain
    definition (reference_gaussian: one torch.normal call per lane) and as what Opacus'
    optimizers get from `_generate_noise`, for sizes around the chunk (4,096 here), its
    16-value blocks and the lanes' threshold (4,096 · 2 here, so 4,096 · 4 and up come in 4
    lanes), on 1, 2 and 3 threads: every clipping mode and thread count draws the same noise."""
    monkeypatch.setattr(noise, "NOISE_CHUNK", 4096)
    monkeypatch.setattr(noise, "LANE_MIN", 4096 * 2)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)  # the lanes' workers, not torch's own
    gen = noise.generator("noise", secure=False)
    state = gen.get_state()
    base = torch.linspace(-1, 1, n)
    ours = noise.add_gaussian_(base.clone(), 2.0, gen)
    after = gen.get_state()
    for draw in (lambda g: noise.reference_gaussian(n, 2.0, g),
                 lambda g: opacus_optimizer._generate_noise(std=2.0, reference=base, generator=g)):
        gen.set_state(state)
        assert torch.equal(ours, base + draw(gen)) and torch.equal(after, gen.get_state())
    assert not torch.equal(ours, base)


def test_two_draws_at_once_share_no_buffer(monkeypatch):
    """Two threads drawing at once (two DP stages in one process) each get exactly their own
    generator's values: the lanes' scratch buffers are per thread, never shared between draws."""
    import threading

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    monkeypatch.setattr(noise, "NOISE_CHUNK", 4096)
    n = 4 * noise.LANE_MIN + 5
    gens = [noise.generator("noise", secure=False) for _ in range(2)]
    states = [g.get_state() for g in gens]
    outs = [torch.zeros(n), torch.zeros(n)]

    def draw(i: int) -> None:
        for _ in range(5):
            noise.add_gaussian_(outs[i], 1.0, gens[i])

    threads = [threading.Thread(target=draw, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for out, gen, state in zip(outs, gens, states):
        gen.set_state(state)
        expected = torch.zeros(n)
        for _ in range(5):
            expected += noise.reference_gaussian(n, 1.0, gen)
        assert torch.equal(out, expected)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_draws_its_lanes_on_threads_of_its_own(monkeypatch):
    """A child forked after the parent drew noise on the lanes' threads inherits their executor
    but not its threads: it must start its own, not wait forever on the parent's."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    gen = noise.generator("noise", secure=False)
    first, second = torch.zeros(2 * noise.LANE_MIN), torch.zeros(2 * noise.LANE_MIN)  # allocated before the fork
    noise.add_gaussian_(first, 1.0, gen)
    pid = os.fork()
    if pid == 0:  # the child: exit 0 once its draw is done
        noise.add_gaussian_(second, 1.0, gen)
        os._exit(0 if np.abs(second.numpy()).sum() > 0 else 1)  # numpy: torch's OpenMP may hang in a forked child
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the child's draw hung or failed"


def test_the_lanes_are_distinct_streams_of_the_secret_generator(monkeypatch):
    """A large draw's 4 lanes: N(0, σ²) each, pairwise uncorrelated, none a copy or shift of the
    step generator's own stream; fixed by the generator's state (the resume checkpoint and the
    test hook hold), different for a different secret, and the generator after the draw is
    where 8 key values and the first lane left it."""
    n = 4 * noise.LANE_MIN
    gen = noise.generator("noise", secure=False)
    state = gen.get_state()
    values = noise.add_gaussian_(torch.zeros(n), 3.0, gen).view(noise.LANES, -1)
    after = gen.get_state()
    assert torch.allclose(values.std(dim=1), torch.full((noise.LANES,), 3.0), rtol=0.01)
    assert torch.corrcoef(values).sub(torch.eye(noise.LANES)).abs().max() < 0.01
    gen.set_state(state)
    torch.empty(8, dtype=torch.int64).random_(0, 2**32, generator=gen)
    plain = torch.normal(0.0, 3.0, (2 * n,), generator=gen)  # what the step generator draws next
    assert torch.equal(plain[:noise.LANE_MIN], values[0])
    for lane in values[1:]:  # no lane reads the step generator's stream from any offset
        starts = (plain[:-64] == lane[0]).nonzero().flatten().tolist()
        assert not any(torch.equal(plain[i:i + 64], lane[:64]) for i in starts)
    gen.set_state(state)
    assert torch.equal(noise.add_gaussian_(torch.zeros(n), 3.0, gen).view(noise.LANES, -1), values)
    assert torch.equal(gen.get_state(), after)
    other = noise.add_gaussian_(torch.zeros(n), 3.0, noise.generator("noise", secure=False)).view(noise.LANES, -1)
    assert all(not torch.equal(a, b) for a, b in zip(values, other))
