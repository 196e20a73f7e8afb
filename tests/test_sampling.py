"""Sampling: llama.cpp's chain semantics on crafted logits, determinism, and draws matching probabilities."""

import math

import pytest
import torch

from specter_gguf.errors import SpecterError
from specter_gguf.sampling import Sampler, SamplingParams
from tests.test_kernels import DEVICES

OFF = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)


def support(p: torch.Tensor) -> list[int]:
    return torch.nonzero(p > 0).reshape(-1).tolist()


def test_defaults_are_llama_cpp_defaults():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n, p.presence_penalty, p.frequency_penalty) == (1.0, 64, 0.0, 0.0)
    assert p.seed is None


def test_greedy_is_argmax_with_lowest_id_on_ties():
    torch.manual_seed(0)
    s = Sampler(SamplingParams(temperature=0.0))
    for _ in range(20):
        logits = torch.randn(1000)
        assert s.sample(logits, []) == int(torch.argmax(logits))
    tied = torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0])
    assert s.sample(tied, []) == 1
    assert Sampler(SamplingParams(temperature=-1.0)).sample(tied) == 1
    probs = s.probabilities(tied, [])
    assert probs.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0]


def test_greedy_applies_penalties_first():
    s = Sampler(SamplingParams(temperature=0.0, repeat_penalty=2.0))
    logits = torch.tensor([1.0, 3.0, 2.0])
    assert s.sample(logits, []) == 1
    assert s.sample(logits, [1]) == 2  # 3/2 = 1.5 < 2


def test_top_k_1_equals_greedy():
    torch.manual_seed(1)
    s = Sampler(SamplingParams(top_k=1, temperature=1.5, top_p=1.0, min_p=0.0, seed=3))
    for _ in range(20):
        logits = torch.randn(500) * 3
        assert s.sample(logits, []) == int(torch.argmax(logits))


def test_fixed_seed_repeats_and_seeds_differ():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)
    a = [Sampler(params).sample(logits, []) for _ in range(3)]
    assert a[0] == a[1] == a[2]
    s1, s2 = Sampler(params), Sampler(params)
    seq1 = [s1.sample(logits, []) for _ in range(50)]
    seq2 = [s2.sample(logits, []) for _ in range(50)]
    assert seq1 == seq2
    s3 = Sampler(SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=99))
    assert [s3.sample(logits, []) for _ in range(50)] != seq1
    # random seed when unset, reported back
    r = Sampler(SamplingParams())
    assert isinstance(r.seed, int) and 0 <= r.seed < 2**64


def test_sample_is_a_draw_from_probabilities():
    logits = torch.randn(200, generator=torch.Generator().manual_seed(7)) * 2
    params = SamplingParams(seed=42)  # default chain: top_k, top_p, min_p, temperature
    a, b = Sampler(params), Sampler(params)
    hist = [3, 4, 5]
    for _ in range(30):
        assert a.sample(logits, hist) == b.draw(b.probabilities(logits, hist))


def test_empirical_distribution_matches_probabilities():
    # 8 tokens survive; N draws; each count's deviation from N*p is bounded by 5 sigma (binomial), and the
    # chi-square statistic (7 degrees of freedom, mean 7, sd ~3.7) stays below 40 (p < 1e-5 to fail by chance).
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -1.5, -8.0, -9.0])
    s = Sampler(SamplingParams(temperature=0.7, top_k=8, top_p=1.0, min_p=0.0, seed=2024))
    probs = s.probabilities(logits, [])
    assert support(probs) == list(range(8))
    assert math.isclose(float(probs.sum()), 1.0, rel_tol=1e-12)
    n = 20000
    counts = torch.zeros(10, dtype=torch.float64)
    for _ in range(n):
        counts[s.sample(logits, [])] += 1
    assert counts[8] == 0 and counts[9] == 0
    exp = probs[:8] * n
    sigma = torch.sqrt(n * probs[:8] * (1 - probs[:8]))
    assert torch.all((counts[:8] - exp).abs() <= 5 * sigma)
    chi2 = float(((counts[:8] - exp) ** 2 / exp).sum())
    assert chi2 < 40.0, chi2


def test_temperature_scales_logits_of_survivors():
    logits = torch.tensor([1.0, 0.0, -1.0])
    p = Sampler(SamplingParams(**{**OFF, "temperature": 0.5})).probabilities(logits)
    ref = torch.softmax(logits.double() / 0.5, 0)
    assert torch.allclose(p, ref, atol=1e-12)


def test_top_k_keeps_exactly_k_largest_ties_lowest_id():
    logits = torch.tensor([0.1, 5.0, 3.0, 3.0, 4.0, 3.0, -2.0])
    p = Sampler(SamplingParams(**{**OFF, "top_k": 3})).probabilities(logits)
    assert support(p) == [1, 2, 4]
    p = Sampler(SamplingParams(**{**OFF, "top_k": 4})).probabilities(logits)
    assert support(p) == [1, 2, 3, 4]
    p = Sampler(SamplingParams(**{**OFF, "top_k": 100})).probabilities(logits)
    assert support(p) == list(range(7))
    ref = torch.softmax(logits.double()[[1, 2, 4]], 0)
    assert torch.allclose(Sampler(SamplingParams(**{**OFF, "top_k": 3})).probabilities(logits)[[1, 2, 4]], ref)


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([0.05, 0.4, 0.3, 0.15, 0.1])
    logits = probs.log()
    # descending: 0.4 (1), 0.3 (2), 0.15 (3), 0.1 (4), 0.05 (0); cumulative 0.4, 0.7, 0.85, 0.95, 1.0
    def keep(top_p):
        return support(Sampler(SamplingParams(**{**OFF, "top_p": top_p})).probabilities(logits))
    assert keep(0.4) == [1]
    assert keep(0.41) == [1, 2]
    assert keep(0.69) == [1, 2]
    assert keep(0.71) == [1, 2, 3]
    assert keep(0.9) == [1, 2, 3, 4]
    assert keep(0.99) == [0, 1, 2, 3, 4]
    assert keep(0.0) == [1]
    p = Sampler(SamplingParams(**{**OFF, "top_p": 0.71})).probabilities(logits)
    assert torch.allclose(p[[1, 2, 3]], torch.tensor([0.4, 0.3, 0.15], dtype=torch.float64) / 0.85)


def test_top_p_uses_logits_before_temperature():
    probs = torch.tensor([0.6, 0.3, 0.1])
    # At temperature 0.1 the scaled softmax would put > 0.99 on token 0, but top_p sees the unscaled one.
    p = Sampler(SamplingParams(**{**OFF, "top_p": 0.8, "temperature": 0.1})).probabilities(probs.log())
    assert support(p) == [0, 1]


def test_top_p_after_top_k_renormalizes_survivors():
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    # top_k=2 leaves 0.4, 0.3 -> renormalized 0.571, 0.429: top_p=0.5 keeps only token 0
    p = Sampler(SamplingParams(**{**OFF, "top_k": 2, "top_p": 0.5})).probabilities(probs.log())
    assert support(p) == [0]


def test_min_p_keeps_tokens_at_least_fraction_of_max():
    probs = torch.tensor([0.5, 0.26, 0.24, 0.0, 0.0]) + torch.tensor([0, 0, 0, 1e-3, 0.06])
    logits = probs.log()
    p = Sampler(SamplingParams(**{**OFF, "min_p": 0.5})).probabilities(logits)
    assert support(p) == [0, 1]  # 0.26/0.5 = 0.52 >= 0.5; 0.24/0.5 = 0.48 < 0.5
    p = Sampler(SamplingParams(**{**OFF, "min_p": 0.1})).probabilities(logits)
    assert support(p) == [0, 1, 2, 4]
    p = Sampler(SamplingParams(**{**OFF, "min_p": 1.0})).probabilities(logits)
    assert support(p) == [0]


def test_repeat_penalty_divides_positive_multiplies_negative():
    logits = torch.tensor([2.0, -2.0, 3.0, 0.0, 1.0, -1.0])
    s = Sampler(SamplingParams(**OFF, repeat_penalty=1.5, repeat_last_n=64))
    out = s.penalized_logits(logits, [0, 1, 3, 0, 0])
    assert out.tolist() == [2.0 / 1.5, -2.0 * 1.5, 3.0, 0.0, 1.0, -1.0]


def test_presence_and_frequency_penalties():
    logits = torch.tensor([2.0, -2.0, 3.0, 0.5])
    s = Sampler(SamplingParams(**OFF, repeat_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5))
    out = s.penalized_logits(logits, [0, 1, 1, 1, 3, 3])
    assert out.tolist() == pytest.approx([2.0 / 2 - 0.5 - 0.25, -2.0 * 2 - 1.5 - 0.25, 3.0, 0.5 / 2 - 1.0 - 0.25])


def test_repeat_last_n_window():
    logits = torch.tensor([1.0, 1.0, 1.0, 1.0])
    hist = [0, 1, 2, 2]
    pen = dict(repeat_penalty=1.0, frequency_penalty=1.0)
    last2 = Sampler(SamplingParams(**OFF, **pen, repeat_last_n=2)).penalized_logits(logits, hist)
    assert last2.tolist() == [1.0, 1.0, -1.0, 1.0]
    whole = Sampler(SamplingParams(**OFF, **pen, repeat_last_n=-1)).penalized_logits(logits, hist)
    assert whole.tolist() == [0.0, 0.0, -1.0, 1.0]
    off = Sampler(SamplingParams(**OFF, **pen, repeat_last_n=0)).penalized_logits(logits, hist)
    assert off.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_penalties_feed_the_distribution():
    logits = torch.tensor([1.0, 1.0])
    p = Sampler(SamplingParams(**OFF, presence_penalty=math.log(3.0))).probabilities(logits, [1])
    assert p.tolist() == pytest.approx([0.75, 0.25])


def test_logits_on_other_dtypes_and_2d_row():
    logits = torch.tensor([[0.5, 2.0, 1.0]], dtype=torch.float16)
    assert Sampler(SamplingParams(temperature=0)).sample(logits, []) == 1
    assert Sampler(SamplingParams(temperature=0)).sample(logits.bfloat16()[0], []) == 1


def test_nan_logits_raise():
    with pytest.raises(SpecterError):
        Sampler(SamplingParams()).sample(torch.tensor([0.0, float("nan")]), [])


def test_draw_and_random_helpers():
    s = Sampler(SamplingParams(seed=0))
    probs = torch.tensor([0.0, 2.0, 0.0, 2.0])  # unnormalized is fine
    draws = {s.draw(probs) for _ in range(100)}
    assert draws == {1, 3}
    u = [s.random() for _ in range(100)]
    assert all(0.0 <= x < 1.0 for x in u)
    with pytest.raises(ValueError):
        s.draw(torch.zeros(3))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature="hot"), "temperature"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.1), "top_p"),
        (dict(min_p=2.0), "min_p"),
        (dict(repeat_penalty=0.0), "repeat_penalty"),
        (dict(repeat_penalty=-1.1), "repeat_penalty"),
        (dict(repeat_last_n=-2), "repeat_last_n"),
        (dict(presence_penalty=float("inf")), "presence_penalty"),
        (dict(frequency_penalty=None), "frequency_penalty"),
        (dict(seed=-1), "seed"),
        (dict(seed=1.5), "seed"),
    ],
)
def test_invalid_params_raise_naming_option(kwargs, name):
    with pytest.raises(SpecterError) as e:
        SamplingParams(**kwargs)
    msg = str(e.value)
    assert name + "=" in msg and "\n" not in msg


def reference_probabilities(logits: torch.Tensor, hist: list[int], p: SamplingParams) -> torch.Tensor:
    """llama.cpp's chain, stage by stage, on a fully sorted candidate list (slow and plain)."""
    x = logits.double().clone()
    if p.repeat_last_n != 0:
        recent = hist if p.repeat_last_n < 0 else hist[-p.repeat_last_n:]
        for t in set(recent):
            c = recent.count(t)
            x[t] = x[t] * p.repeat_penalty if x[t] <= 0 else x[t] / p.repeat_penalty
            x[t] -= c * p.frequency_penalty + p.presence_penalty
    cand = sorted(range(len(x)), key=lambda i: (-float(x[i]), i))
    if p.top_k > 0:
        cand = cand[: p.top_k]
    if p.top_p < 1.0:
        pr = torch.softmax(x[cand], 0)
        cum, keep = 0.0, len(cand)
        for i, q in enumerate(pr.tolist()):
            cum += q
            if cum >= p.top_p:
                keep = i + 1
                break
        cand = cand[:keep]
    if p.min_p > 0.0:
        thr = float(x[cand[0]]) + math.log(p.min_p)
        cand = [cand[0]] + [i for i in cand[1:] if float(x[i]) >= thr]
    out = torch.zeros(len(x), dtype=torch.float64)
    out[cand] = torch.softmax(x[cand] / p.temperature, 0)
    return out


@pytest.mark.parametrize("trial", range(40))
def test_chain_matches_plain_reference(trial):
    g = torch.Generator().manual_seed(trial)
    n = [50, 300, 2000][trial % 3]
    logits = torch.round(torch.randn(n, generator=g) * 4, decimals=1)  # rounding makes ties common
    hist = torch.randint(0, n, (int(torch.randint(0, 80, (1,), generator=g)),), generator=g).tolist()
    r = lambda: float(torch.rand((), generator=g))  # noqa: E731
    p = SamplingParams(
        temperature=[0.3, 0.8, 1.0, 1.7][trial % 4],
        top_k=[0, 1, 5, 40, 200, 5000][trial % 6],
        top_p=[1.0, 0.5, 0.9, 0.95, 0.999][trial % 5],
        min_p=[0.0, 0.05, 0.2][trial % 3 if trial % 7 else 0],
        repeat_penalty=[1.0, 1.1, 1.5][trial % 3],
        repeat_last_n=[64, -1, 0, 8][trial % 4],
        presence_penalty=r() - 0.5,
        frequency_penalty=r() - 0.5,
        seed=trial,
    )
    got = Sampler(p).probabilities(logits, hist)
    ref = reference_probabilities(logits, hist, p)
    assert support(got) == support(ref)
    assert torch.allclose(got, ref, atol=1e-12, rtol=1e-9)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU"))])
def test_top_k_where_the_logits_are_equals_the_host_chain(device):
    """With top_k on, penalties and top_k run on the logits' device and only the candidates are read back: the
    distribution equals the one the all-host chain gives (a list of logits takes that path), ties included, and
    the caller's logits are left as they were."""
    g = torch.Generator().manual_seed(5)
    logits = torch.round(torch.randn(5000, generator=g) * 4, decimals=1)
    hist = list(range(0, 5000, 37))
    for p in (SamplingParams(top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.3, seed=0),
              SamplingParams(top_k=7, top_p=1.0, min_p=0.0, presence_penalty=0.5, seed=0)):
        on_device = logits.to(device)
        got = Sampler(p).probabilities(on_device, hist)
        assert torch.equal(on_device.cpu(), logits)
        assert torch.equal(got, Sampler(p).probabilities(logits.tolist(), hist))


@pytest.mark.parametrize("device", DEVICES)
def test_device_chain_equals_the_host_chain(device):
    """`chain_probabilities` (the chain of sampling on the device, over the top_k candidates only, ids ascending;
    native up to kernels.SAMPLE_MAX_CANDIDATES of them, torch ops with top_k off) gives `Sampler.probabilities`'
    distribution row by row, ties at the top_k boundary included (the lowest ids), and `chain_sample` draws what
    `Sampler.draw` draws from that distribution with the same uniform."""
    from specter_gguf.sampling import chain_candidates, chain_knobs, chain_probabilities, chain_sample

    g = torch.Generator().manual_seed(11)
    n_vocab, R = 3000, 8
    logits = torch.randn(R, n_vocab, generator=g) * 3  # float32, as the model's logits
    logits[5:] = torch.round(logits[5:]) / 2  # a few values, many ties each
    logits[7, 1000:] = 4.0  # ties at the boundary of every top_k below
    chains = [SamplingParams(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05),
              SamplingParams(temperature=0.7, top_k=200, top_p=0.5, min_p=0.0),
              SamplingParams(temperature=1.3, top_k=0, top_p=1.0, min_p=0.2),  # top_k off: the whole vocabulary
              SamplingParams(temperature=1.0, top_k=5, top_p=1.0, min_p=0.0)]
    # the uniform a fresh sampler of seed s draws first, and that sampler's draw from the same distribution
    uniforms = torch.tensor([Sampler(SamplingParams(seed=s)).random() for s in range(R)], dtype=torch.float64)
    for params in chains:
        C = chain_candidates(params, n_vocab)
        knobs = chain_knobs(params).to(device)
        ids, probs = chain_probabilities(logits.to(device), C, knobs)
        assert ids.shape == probs.shape == (R, C)
        assert bool((ids[:, 1:] > ids[:, :-1]).all())
        full = torch.zeros(R, n_vocab, dtype=torch.float64).scatter_(1, ids.cpu(), probs.cpu())
        sampler = Sampler(params)
        for row in range(R):
            want = sampler.probabilities(logits[row])
            assert support(full[row]) == support(want)
            assert torch.allclose(full[row], want, atol=1e-12, rtol=1e-9)
        drawn_ids, drawn_probs, drawn = chain_sample(logits.to(device), C, knobs, uniforms.to(device))
        assert torch.equal(drawn_ids, ids) and torch.equal(drawn_probs, probs)
        assert drawn.cpu().tolist() == [Sampler(SamplingParams(seed=s)).draw(full[s]) for s in range(R)]

