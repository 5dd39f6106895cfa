"""Where DP randomness comes from: secret OS entropy, never the config's seed.

An attacker reads everything a run publishes, the config's `seed` included. Any randomness
a DP guarantee relies on must therefore be unpredictable from it: the DP-SGD noise, the
Poisson sample (amplification by subsampling assumes the sample is secret), the record
picked for each sampled user, and the histogram noise of the control codes. Everything
else (splits, prompts, dropout) keeps following `seed`.

Two sources, both keyed from `os.urandom`:

- default: torch's mt19937 with its whole state (624 words, 19,937 bits that count) from secret bytes
  (`manual_seed` would keep only a seed's low 32 bits: 2³² streams, few enough to try them
  all). Unpredictable from anything published, fast, but not a cryptographic generator.
  A CUDA generator (Philox) takes its 64-bit seed whole. A large DP-SGD draw on a CPU comes
  in lanes (below): parts from mt19937s keyed off the step's generator, on parallel threads.
- `secure=True`: `ChaCha20Normal`, a ChaCha20 keystream (the `cryptography` package) with
  a 256-bit key, turned into uniforms and Box–Muller Gaussians in float64. Opacus' own
  secure mode needs torchcsprng, which has no release for current torch; here the noise
  reaches Opacus' optimizers through a dispatcher around `_generate_noise`, installed when
  this module is imported, that handles a `ChaCha20Normal` generator and passes anything
  else to Opacus unchanged.

Generator states go only into the private resume checkpoint (`get_state`/`set_state`),
never into a released file.

Tests that need identical runs set `DPDISTILL_TEST_NOISE_SEED`: every generator is then
derived from it, and `source()` says "TEST HOOK ...: NOT private", which the ledger
records and `compose()` flags.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

from pipeline.privacy.ledger import TEST_HOOK

log = logging.getLogger(__name__)

TEST_SEED_ENV = "DPDISTILL_TEST_NOISE_SEED"


def _test_seed() -> int | None:
    value = os.environ.get(TEST_SEED_ENV)
    return None if value in (None, "") else int(value)


def _secret_bytes(n: int, purpose: str, rank: int = 0) -> bytes:
    """n bytes of OS entropy, or, under the test hook, bytes derived from its seed."""
    seed = _test_seed()
    if seed is None:
        return os.urandom(n)
    log.warning("%s is set: the %s randomness is fixed and anyone can regenerate it; NOT private "
                "(for tests only)", TEST_SEED_ENV, purpose)
    return hashlib.shake_256(f"{seed}:{purpose}:{rank}".encode()).digest(n)


def source(secure: bool) -> str:
    """What the DP noise of a run made now comes from, as the ledger records it."""
    seed = _test_seed()
    if seed is not None:
        return f"{TEST_HOOK} fixed seed ({TEST_SEED_ENV}={seed}): reproducible, NOT private"
    if secure:
        return "csprng: ChaCha20 keyed with 256 bits from os.urandom (Box–Muller Gaussians, float64)"
    return "os-entropy: torch mt19937, its 624-word state from os.urandom (not a CSPRNG)"


def legacy_source(secure: bool) -> str:
    """What a resumed teacher's generators came from when its checkpoint does not say: before
    they were keyed whole (`keyed_mt19937`), torch's ones were seeded with `manual_seed`."""
    if secure or _test_seed() is not None:
        return source(secure)
    return "os-entropy: torch mt19937 seeded by manual_seed, 32 secret bits (not a CSPRNG; an older checkpoint)"


class ChaCha20Normal:
    """Cryptographically secure uniforms and Gaussians from a ChaCha20 keystream.

    Each draw encrypts zeros under (key, nonce = number of draws so far), so the state is
    just (key, draws): saved in a checkpoint, it resumes the exact same stream.
    """

    def __init__(self, key: bytes, draws: int = 0):
        assert len(key) == 32
        self.key, self.draws = key, draws

    KEYSTREAM_CHUNK = 1 << 20  # uniforms made from one piece of keystream (8 MB)

    def uniform(self, n: int) -> torch.Tensor:
        """n float64 uniforms in (0, 1]: the top 53 bits of each 64-bit word of the keystream
        under nonce = draws, centred. The keystream is written into a reused buffer a chunk at a
        time (cryptography's `update_into`: 2-4x `update`'s rate here, which allocated a new
        bytes object as large as the draw), the same bytes in the same order."""
        # cryptography's 16-byte ChaCha20 nonce: 4-byte block counter (from 0), then 12 bytes.
        nonce = b"\0" * 4 + self.draws.to_bytes(12, "little")
        self.draws += 1
        stream = Cipher(algorithms.ChaCha20(self.key, nonce), mode=None).encryptor()
        chunk = max(1, min(n, self.KEYSTREAM_CHUNK))
        zeros, buffer = bytes(8 * chunk), bytearray(8 * chunk + 64)  # update_into wants room beyond the data
        words = np.frombuffer(buffer, dtype=np.uint64, count=chunk)
        u = np.empty(n, dtype=np.float64)
        for i in range(0, n, chunk):
            m = min(chunk, n - i)
            stream.update_into(zeros[:8 * m], buffer)
            np.right_shift(words[:m], np.uint64(11), out=words[:m])
            u[i:i + m] = words[:m]
        u += 0.5
        u *= 2.0**-53
        return torch.from_numpy(u)

    def normal(self, n: int) -> torch.Tensor:
        """n float64 standard Gaussians (Box–Muller, both outputs used; in place: it is the
        cost of secure mode, see bench/secure_noise.py)."""
        m = (n + 1) // 2
        u = self.uniform(2 * m)
        r, theta = u[:m].log_().mul_(-2.0).sqrt_(), u[m:].mul_(2.0 * math.pi)
        out = torch.empty(2 * m, dtype=torch.float64)
        torch.mul(r, torch.cos(theta), out=out[:m])
        torch.mul(r, theta.sin_(), out=out[m:])
        return out[:n]

    def state_dict(self) -> dict:
        return {"key": torch.tensor(list(self.key), dtype=torch.uint8), "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.key, self.draws = bytes(state["key"].tolist()), int(state["draws"])


Generator = torch.Generator | ChaCha20Normal


def generator(purpose: str, *, secure: bool, rank: int = 0, device: torch.device | str = "cpu") -> Generator:
    """A secret generator for one use (`purpose`: 'noise', 'poisson', 'user_pick', ...).

    Every data-parallel rank gets its own. Under the test hook the generators are fixed,
    and the Poisson sampler's is the same on every rank (callers pass rank=0 for it), so
    a data-parallel run draws exactly the single-process sample.
    """
    if secure:
        return ChaCha20Normal(_secret_bytes(32, purpose, rank))
    g = torch.Generator(device=device)
    if g.device.type == "cpu":
        keyed_mt19937(g, _secret_bytes(4 * MT_WORDS, purpose, rank))
    else:  # CUDA's Philox: the 64-bit seed is its whole key
        g.manual_seed(int.from_bytes(_secret_bytes(8, purpose, rank), "little"))
    return g


MT_WORDS = 624  # mt19937's state: 624 32-bit words
_MT_STATE = slice(24, 24 + 8 * MT_WORDS)  # where they sit in a CPU generator's state, one per uint64


def keyed_mt19937(g: torch.Generator, key: bytes, check: bool = True) -> None:
    """Set a CPU generator's whole mt19937 state from 2,496 bytes (624 words; an all-zero key is
    refused). `manual_seed` fills the state from the seed's low 32 bits
    only, so 64 secret bits there were 32. The state layout is torch's CPUGeneratorImplState
    (uint64 seed, int left, int seeded, uint64 next, uint64 state[624], the normal caches): a
    freshly seeded state with its words replaced. Checked each time against numpy's MT19937
    keyed alike: the generator's first 64-bit draw must be that generator's first two words
    (`check=False` skips that, for the lanes' generators once `_check_state_layout` ran)."""
    words = np.frombuffer(key, dtype=np.uint32)
    if words.shape != (MT_WORDS,) or not words.any():
        raise ValueError(f"mt19937 needs {4 * MT_WORDS} bytes, not all zero")
    g.manual_seed(0)  # left = 1, seeded = 1, next = 0, normal caches empty: the first draw twists the state
    state = g.get_state()
    state[_MT_STATE] = torch.from_numpy(words.astype(np.uint64).view(np.uint8).copy())
    g.set_state(state)
    if not check:
        return
    reference = np.random.MT19937(0)
    reference.state = {"bit_generator": "MT19937", "state": {"key": words.copy(), "pos": MT_WORDS}}
    first = (int(reference.random_raw()) << 32 | int(reference.random_raw())) & (2**63 - 1)
    if int(torch.empty(1, dtype=torch.int64).random_(generator=g)) != first:
        raise RuntimeError("torch's CPU generator state has a layout pipeline/privacy/noise.py does not "
                           "know, so it cannot key it; use teacher.secure_mode=true")
    g.set_state(state)


def uniform(gen: Generator, n: int) -> torch.Tensor:
    """n float64 uniforms in [0, 1), 53 random bits each, from either kind of generator (on the
    CPU). Not torch's default float32 (24 bits): the Poisson sample's `u < q` would then include
    each unit with probability q rounded up to a multiple of 2⁻²⁴, not the q accounted, and the
    geometric mechanism's inverse CDF (control_codes.py) would cut its noise off at 24·ln 2 / ε
    (34 at ε = 0.5), making some noisy counts possible under one neighbouring dataset and
    impossible under the other."""
    if isinstance(gen, ChaCha20Normal):
        return gen.uniform(n)
    return torch.rand(n, generator=gen, dtype=torch.float64)


def normal(gen: Generator, std: float, n: int) -> torch.Tensor:
    """n float64 N(0, std²) values from either kind of generator (ChaCha: the secure sum)."""
    if isinstance(gen, ChaCha20Normal):
        return secure_gaussian(gen, std, (n,))
    return torch.normal(0.0, std, (n,), generator=gen, dtype=torch.float64)


def randbelow(gen: Generator, k: int) -> int:
    """A uniform integer in [0, k) (ChaCha: bias below k / 2^53, negligible)."""
    if isinstance(gen, ChaCha20Normal):
        return min(int(gen.uniform(1).item() * k), k - 1)
    return int(torch.randint(k, (1,), generator=gen).item())


def get_state(gen: Generator):
    return gen.state_dict() if isinstance(gen, ChaCha20Normal) else gen.get_state()


def set_state(gen: Generator, state) -> None:
    if isinstance(gen, ChaCha20Normal):
        gen.load_state_dict(state)
    else:
        gen.set_state(state)


def secure_gaussian(gen: ChaCha20Normal, std: float, shape, dtype=torch.float64, device="cpu") -> torch.Tensor:
    """N(0, std²) noise of `shape` as Opacus' secure mode makes it: the sum of 4 Gaussians
    of std `std`, halved (Holohan & Braghin 2021, §5.1: a floating-point representation
    attack on one Gaussian sample costs 2^53, on the sum of 2n = 4 about 2^159)."""
    n = math.prod(shape)
    total = gen.normal(n)  # float64
    for _ in range(3):
        total += gen.normal(n)
    total *= std / 2.0
    return total.view(*shape).to(device=device, dtype=dtype)


# --- DP-SGD's noise on a CPU: in parallel lanes, added in place -------------------------
# torch's CPU generator is one serial mt19937: drawing a 135 M-parameter model's noise took
# 0.86 s of a 10 s DP step on one core, with the other core idle (docs/teacher_modes.md). A
# large draw is therefore split into LANES parts, each with its own generator, and the parts
# are drawn on up to torch.get_num_threads() threads at once. Part 1 comes from the step's
# generator; parts 2..LANES from mt19937s keyed (all 624 words) by SHAKE-256 of 256 bits
# drawn from it, so the noise stays a function of that one secret generator: unpredictable
# from anything published, resumed from its checkpointed state, fixed by the test hook, and
# the same for any thread count. Every clipping mode draws it: bk in place (add_gaussian_),
# Opacus' optimizers through the dispatcher below.

LANES = 4  # parts of a large draw, one generator each (a fixed number: the noise must not depend on the threads)
LANE_MIN = 1 << 18  # smaller draws come whole from the step's generator, as Opacus draws them
NOISE_CHUNK = 1 << 20  # values drawn into a lane's scratch buffer at a time (4 MB)
_scratch = threading.local()  # each thread's buffer (.buffer), made on first use: two draws at once never share one
_pool: dict[int, ThreadPoolExecutor] = {}  # pid -> the lanes' threads, made on first use in that process


def cpu_draw(generator, reference: torch.Tensor, secure_mode: bool) -> bool:
    """Whether `add_gaussian_` can add a DP step's noise to `reference`: torch's CPU generator
    and a contiguous fp32 CPU tensor."""
    return (isinstance(generator, torch.Generator) and generator.device.type == "cpu" and not secure_mode
            and reference.device.type == "cpu" and reference.dtype == torch.float32 and reference.is_contiguous())


def lanes(gen: torch.Generator, n: int) -> list[tuple[int, int, torch.Generator]]:
    """The parts (start, stop, generator) of an n-value draw from `gen`. Under LANE_MIN values:
    one part, `gen` itself. Else LANES parts of equal size (the last shorter); drawing the lanes'
    key advances `gen` by 8 32-bit values before part 1 draws from it."""
    if n < LANE_MIN:
        return [(0, n, gen)]
    _check_state_layout()
    key = torch.empty(8, dtype=torch.int64).random_(0, 2**32, generator=gen).numpy().astype(np.uint32).tobytes()
    size = -(-n // LANES)
    parts = [(0, size, gen)]
    for j in range(1, LANES):
        g = torch.Generator()
        keyed_mt19937(g, hashlib.shake_256(key + bytes([j])).digest(4 * MT_WORDS), check=False)
        parts.append((j * size, min(n, (j + 1) * size), g))
    return parts


@functools.cache
def _check_state_layout() -> None:
    """Once a process: keyed_mt19937's check that torch's CPU generator state has the layout it
    writes (~0.2 ms, against 15 µs for the keying alone; the lanes key 3 generators a parameter)."""
    keyed_mt19937(torch.Generator(), hashlib.shake_256(b"layout").digest(4 * MT_WORDS))


def reference_gaussian(n: int, std: float, gen: torch.Generator) -> torch.Tensor:
    """The n fp32 values add_gaussian_ adds, drawn the plain way: each lane's part in one call
    of torch.normal on its generator (the definition tests/privacy/test_noise.py checks against)."""
    return torch.cat([torch.normal(0.0, std, (stop - start,), generator=g) for start, stop, g in lanes(gen, n)])


def add_gaussian_(out: torch.Tensor, std: float, gen: torch.Generator) -> torch.Tensor:
    """out += N(0, std²) noise: the values of `reference_gaussian`, lanes drawn on parallel
    threads, without Opacus' two temporaries the size of the parameter (zeros, then the draw)
    and the third pass that adds them. Each lane draws NOISE_CHUNK values at a time into its
    thread's scratch buffer and adds them while they are in cache. Equal to one call per lane because
    torch's mt19937 normal fill of n ≥ 16 values draws n uniforms and transforms them 16 at a
    time, the last 16 again when n is not a multiple of 16: chunks of a multiple of 16, with a
    short tail folded into the last chunk, consume the stream as one call does."""
    assert cpu_draw(gen, out, False)
    flat = out.view(-1)
    tasks = [(flat[start:stop], g) for start, stop, g in lanes(gen, flat.numel())]
    workers = min(len(tasks), torch.get_num_threads())
    if workers <= 1:
        _add_lanes(tasks, std)
        return out
    pool = _pool.get(os.getpid())  # a forked child inherits the parent's executor but not its threads
    if pool is None:
        pool = _pool[os.getpid()] = ThreadPoolExecutor(max_workers=LANES - 1, thread_name_prefix="dp-noise")
    groups = [tasks[w::workers] for w in range(workers)]  # worker w draws lanes w, w + workers, ...
    futures = [pool.submit(_add_lanes, group, std) for group in groups[1:]]
    _add_lanes(groups[0], std)
    for future in futures:
        future.result()
    return out


def _add_lanes(tasks: list, std: float) -> None:
    for task in tasks:
        _add_lane(*task, std)


def _add_lane(flat: torch.Tensor, gen: torch.Generator, std: float) -> None:
    """Draw one lane into `flat`. The sum is numpy's (the same float32 addition as torch's):
    torch's add would start an OpenMP team in every lane thread, and with more OpenMP threads
    than cores libgomp stops spinning between parallel regions, which slowed every small
    operator of the next forward and backward (bench/teacher_modes.py: a pass 15 % slower)."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() != NOISE_CHUNK + 16:
        buffer = _scratch.buffer = torch.empty(NOISE_CHUNK + 16)
    values, drawn = flat.numpy(), buffer.numpy()  # numpy releases the GIL in the addition, as torch does
    i, n = 0, flat.numel()
    while i < n:
        m = n - i if n - i < NOISE_CHUNK + 16 else NOISE_CHUNK  # never a last chunk under 16 values
        buffer[:m].normal_(0.0, std, generator=gen)  # serial: torch's CPU normal fill takes the generator's lock
        np.add(values[i:i + m], drawn[:m], out=values[i:i + m])
        i += m


# --- Opacus: route our draws through the optimizers' noise function --------------------
# Opacus' DP optimizers call the module-level `_generate_noise(std, reference, generator,
# secure_mode)`, which needs a torch.Generator. The dispatcher handles a ChaCha20Normal
# generator, draws a CPU generator's fp32 noise in lanes (the values bk adds in place), and
# leaves every other call to the original.

def _install_dispatcher() -> None:
    import importlib

    from opacus.optimizers import optimizer as base

    original = getattr(base._generate_noise, "_opacus_original", base._generate_noise)

    def _generate_noise(std, reference, generator=None, secure_mode=False):
        if isinstance(generator, ChaCha20Normal):
            if std == 0:
                return torch.zeros(reference.shape, device=reference.device, dtype=reference.dtype)
            return secure_gaussian(generator, std, reference.shape, reference.dtype, reference.device)
        if std != 0 and cpu_draw(generator, reference, secure_mode):
            return add_gaussian_(torch.zeros_like(reference), std, generator)
        return original(std=std, reference=reference, generator=generator, secure_mode=secure_mode)

    _generate_noise._opacus_original = original
    for name in ("optimizer", "optimizer_fast_gradient_clipping", "ddp_perlayeroptimizer",
                 "fsdpoptimizer_fast_gradient_clipping", "adaclipoptimizer"):
        try:
            module = importlib.import_module(f"opacus.optimizers.{name}")
        except ImportError:  # e.g. FSDP pieces missing from a torch build
            continue
        if hasattr(module, "_generate_noise"):
            module._generate_noise = _generate_noise


_install_dispatcher()
