"""The language-model benchmark (`benchmarks/lm.py`): its smoke preset end to end, its corpus split, its validation
protocol and its cached greedy decoding."""

import dataclasses
import hashlib
import importlib
import importlib.metadata
import json
import math
import pathlib
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import eqx_quant


BENCHMARKS = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
lm = importlib.import_module("lm")
lm_data = importlib.import_module("lm_data")
lm_model = importlib.import_module("lm_model")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """The smoke preset run with a cache folder (which it trains the float model into), and the float model looked up
    in that folder again."""
    root = tmp_path_factory.mktemp("lm")
    lines: list[str] = []
    first = lm.run("smoke", root / "first", cache=root / "cache", progress=False, log=lines.append)
    model, training = lm.float_model(lm.prepare(lm.PRESETS["smoke"], progress=False), root / "cache")
    second = {"model": model, "training": training}
    return root, first, second, lines


def _params_by_hand(vocab: int, dim: int, depth: int) -> int:
    # Per block: two LayerNorms (2 * 2 * dim), qkv (3 dim^2 + 3 dim), out projection (dim^2 + dim), MLP (4 dim^2 +
    # 4 dim and 4 dim^2 + dim). Then the final LayerNorm and the embedding (the head is tied to it).
    block = 4 * dim + 3 * dim * dim + 3 * dim + dim * dim + dim + 4 * dim * dim + 4 * dim + 4 * dim * dim + dim
    return vocab * dim + depth * block + 2 * dim


@pytest.mark.slow
def test_smoke_run_writes_plausible_results(smoke):
    root, first, second, lines = smoke
    preset = lm.PRESETS["smoke"]
    written = json.loads((root / "first" / "lm_results.json").read_text())
    assert written == json.loads(json.dumps(first))  # what run returns is what it wrote
    assert {"config", "float", "control", "rows", "qat_step_ratio", "generation"} <= set(written)
    config = written["config"]
    vocab = config["vocab_size"]
    assert vocab == 84 and config["corpus_sha256"] == lm_data.EXCERPT_SHA256
    assert config["params"] == _params_by_hand(vocab, preset.dim, preset.depth) == 28160
    assert config["train_chars"] == preset.train_chars and config["val_chars"] == preset.val_chars
    assert config["val_scored_chars"] == preset.val_windows * (preset.context // 2)
    assert sorted(config["val_plays"]) == sorted(lm_data.VALIDATION_PLAYS)

    f, c = written["float"], written["control"]
    for name, value in (("float", f["val_bpc"]), ("control", c["val_bpc"])):
        assert isinstance(value, float) and math.isfinite(value), (name, value)
        assert 0.0 < value < math.log2(vocab), (name, value)  # better than a uniform guess
    assert f["val_bpc"] != c["val_bpc"]  # the control fine-tuned the model
    assert abs(f["val_bpc"] - c["val_bpc"]) < 0.5
    assert f["file_bytes"] == (root / "first" / "float.eqx").stat().st_size
    assert f["file_bytes"] > 4 * config["params"]  # every parameter in float32, plus headers
    assert f["steps"] == preset.steps and c["steps"] == preset.finetune_steps
    assert math.isfinite(f["train_seconds"]) and f["train_seconds"] > 0 and f["cached"] is False
    assert all(math.isfinite(x) for x in f["losses"]) and f["losses"][-1] < f["losses"][0]

    rows = written["rows"]
    assert [(r["recipe"], r["method"]) for r in rows] == [(r, m) for r in preset.recipes for m in lm.METHODS]
    for row in rows:
        # The converted integer model computes exactly what the fake-quantized one does.
        assert row["converted_val_bpc"] == row["val_bpc"], row
        assert 0.0 < row["val_bpc"] < math.log2(vocab), row
        assert isinstance(row["file_bytes"], int) and row["file_bytes"] < f["file_bytes"] / 3, row
    assert all(r["file_bytes"] < f["file_bytes"] / 4 for r in rows)  # 4-bit weights
    # Quantization moves every row off the float model, and the methods differ from each other.
    assert all(r["val_bpc"] != f["val_bpc"] for r in rows)
    assert len({r["val_bpc"] for r in rows if r["recipe"] == "w4a8_g32"}) == len(lm.METHODS)
    assert math.isfinite(written["qat_step_ratio"]) and written["qat_step_ratio"] > 0
    assert written["qat_step_ratio"] == written["step_seconds"]["w4a8_g32"] / written["step_seconds"]["float"]

    g = written["generation"]
    assert len(g["sample"]) == len(g["float_sample"]) == preset.generate_tokens and g["prompt"] == lm.PROMPT
    assert g["steps"] == len(lm.PROMPT) + preset.generate_tokens - 1
    for key in ("float_tokens_per_s", "int_tokens_per_s"):
        assert math.isfinite(g[key]) and g[key] > 0, key

    assert lines[0].startswith("float: trained 200 steps")
    row_lines = [f"{r} {m}" for r in preset.recipes for m in lm.METHODS]
    assert [line.split(":")[0] for line in lines] == ["float", "control", *row_lines, "step", "generation"]

    # Looked up again, the float model comes from the cache: the trained model, bit for bit, with its training figures.
    assert second["training"]["cached"] is True
    for key in ("train_seconds", "losses", "steps"):
        assert second["training"][key] == f[key], key
    saved = eqx_quant.load(root / "first" / "float.eqx", second["model"])
    for a, b in zip(jax.tree.leaves(second["model"]), jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_float_bpc_follows_the_protocol(smoke):
    # Recomputes the float model's validation bits per character from the saved file, with the windows built from
    # the protocol's formula and the log-probabilities in float64 NumPy.
    root, first, _, _ = smoke
    preset = lm.PRESETS["smoke"]
    corpus = lm_data.load_excerpt()
    like = lm_model.GPT(corpus.vocab_size, preset.dim, preset.heads, preset.depth, key=jax.random.key(1))
    model = eqx_quant.load(root / "first" / "float.eqx", like)
    val = corpus.val[: preset.val_chars]
    t, n = preset.context, preset.val_windows
    forward = eqx.filter_jit(lambda model, tokens: model(tokens))
    total = 0.0
    for i in range(n):
        start = i * (len(val) - t - 1) // (n - 1)
        window = val[start : start + t + 1]
        logits = np.asarray(forward(model, jnp.asarray(window[:-1])), np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
        total -= sum(log_probs[j, window[j + 1]] for j in range(t // 2, t))
    expected = total / (n * (t - t // 2)) / math.log(2)
    assert first["float"]["val_bpc"] == pytest.approx(expected, rel=1e-5)


def test_validation_windows_formula_and_overlap():
    stream = np.arange(100, dtype=np.int32)
    windows = lm.validation_windows(stream, 8, 5)
    starts = [0, 22, 45, 68, 91]  # i * 91 // 4
    np.testing.assert_array_equal(windows, np.array([np.arange(s, s + 9) for s in starts]))
    # 23 windows of 9 characters in 100 are 4 apart: their scored halves (4 characters each) just fit; 24 do not.
    assert lm.validation_windows(stream, 8, 23).shape == (23, 9)
    with pytest.raises(ValueError, match="twice"):
        lm.validation_windows(stream, 8, 24)


def test_learning_rate_schedule():
    assert lm.learning_rate_at(0, 1.0, 10, 110) == pytest.approx(0.1)
    assert lm.learning_rate_at(9, 1.0, 10, 110) == pytest.approx(1.0)
    assert lm.learning_rate_at(60, 1.0, 10, 110) == pytest.approx(0.55)
    assert lm.learning_rate_at(110, 1.0, 10, 110) == pytest.approx(0.1)


def _hand_made_plays() -> dict[str, str]:
    return {"alpha": "**A**  \nTo be, or not to be.\n", "beta": "**A**  \nTo be.\n", "gamma": "**C**  \nNot so!\n"}


def test_corpus_split_is_disjoint_and_complete():
    plays = _hand_made_plays()
    digest = hashlib.sha256("".join(plays.values()).encode()).hexdigest()
    corpus = lm_data.corpus_of(plays, ("beta",), digest)
    assert corpus.val_plays == ("beta",) and corpus.train_plays == ("alpha", "gamma")
    train_text, val_text = plays["alpha"] + plays["gamma"], plays["beta"]
    assert corpus.decode(corpus.train) == train_text and corpus.decode(corpus.val) == val_text
    assert corpus.chars == "".join(sorted(set(train_text))) and corpus.sha256 == digest
    assert lm_data.VALIDATION_PLAYS == ("macbeth", "richard-ii", "twelfth-night")
    # A validation play with a character no training play has cannot be encoded.
    with pytest.raises(ValueError, match="outside the vocabulary"):
        lm_data.corpus_of(plays, ("gamma",), digest)


def test_corpus_refuses_a_wrong_digest_and_bad_plays():
    plays = _hand_made_plays()
    digest = hashlib.sha256("".join(plays.values()).encode()).hexdigest()
    with pytest.raises(ValueError, match=digest):
        lm_data.corpus_of(plays, ("beta",), "0" * 64)
    with pytest.raises(ValueError, match="hamlett"):
        lm_data.corpus_of(plays, ("hamlett",), digest)
    for bad in ((), ("alpha", "beta", "gamma"), ("beta", "beta")):
        with pytest.raises(ValueError, match="validation_plays"):
            lm_data.corpus_of(plays, bad, digest)


def test_excerpt_is_the_smoke_presets_corpus():
    corpus = lm_data.load_excerpt()
    train_chars, val_chars = lm_data.EXCERPT_CHARS
    assert (len(corpus.train), len(corpus.val)) == (train_chars, val_chars) == (200_000, 20_000)
    assert (lm.PRESETS["smoke"].train_chars, lm.PRESETS["smoke"].val_chars) == lm_data.EXCERPT_CHARS
    assert corpus.decode(corpus.train).startswith("# A Midsummer Night's Dream") and corpus.vocab_size == 84
    text = (lm_data.EXCERPT / "val.md").read_text(encoding="utf-8")
    assert corpus.decode(corpus.val) == text and "**" in text
    with pytest.raises(ValueError, match=lm_data.EXCERPT_SHA256):
        lm_data.load_excerpt(expected_sha256="0" * 64)


@pytest.mark.slow
def test_cached_greedy_decoding_equals_full_recomputation(smoke):
    root, _, _, _ = smoke
    preset = lm.PRESETS["smoke"]
    corpus = lm_data.load_excerpt()
    new = lambda seed: lm_model.GPT(  # noqa: E731
        corpus.vocab_size, preset.dim, preset.heads, preset.depth, key=jax.random.key(seed)
    )
    trained = eqx_quant.load(root / "first" / "float.eqx", new(1))
    full_forward = eqx.filter_jit(lambda model, tokens: model(tokens))
    prompt = corpus.encode("**ROMEO**")
    total = preset.context
    random_tokens = np.random.default_rng(0).integers(0, corpus.vocab_size, total).astype(np.int32)
    for model, trained_model in ((trained, True), (new(11), False)):
        generated = np.asarray(lm_model.greedy_generate(model, jnp.asarray(prompt), total - len(prompt)))
        # Reference: the whole forward pass over a fixed-length buffer at every step (later positions do not
        # affect earlier ones under the causal mask), taking the argmax at the last written position.
        tokens = np.zeros(total, np.int32)
        tokens[: len(prompt)] = prompt
        for i in range(len(prompt), total):
            tokens[i] = int(np.argmax(np.asarray(full_forward(model, jnp.asarray(tokens))[i - 1])))
        np.testing.assert_array_equal(generated, tokens[len(prompt) :])
        if trained_model:  # an untrained model soon repeats one character; the trained one writes words
            assert len(set(generated.tolist())) > 5

        # Fed a random sequence token by token through the cache, every position's logits are those of the full
        # forward pass.
        def step(caches, index, model=model):
            logits, caches = model.decode(jnp.asarray(random_tokens)[index], caches, index)
            return caches, logits

        _, cached = jax.lax.scan(step, lm_model.empty_caches(model, total), jnp.arange(total))
        full = np.asarray(full_forward(model, jnp.asarray(random_tokens)))
        np.testing.assert_allclose(np.asarray(cached), full, rtol=1e-5, atol=1e-5)


def test_main_refuses_an_unknown_preset(tmp_path):
    with pytest.raises(SystemExit) as info:
        lm.main(["--preset", "huge", "--out", str(tmp_path)])
    assert info.value.code == 2
    with pytest.raises(ValueError, match="`preset`"):
        lm.run("huge", tmp_path)
    with pytest.raises(ValueError, match="w5a8"):
        lm.run("smoke", tmp_path, recipes=("w5a8",))
    with pytest.raises(ValueError, match="`methods`"):
        lm.run("smoke", tmp_path, methods=("spinquant",))
    assert not (tmp_path / "lm_results.json").exists()


def test_results_option_prints_and_plots_without_running(tmp_path, capsys):
    rows = [
        {
            "recipe": r,
            "method": m,
            "val_bpc": 2.0 + b / 100 + i,
            "converted_val_bpc": 2.0 + b / 100 + i,
            "file_bytes": 10,
        }
        for r, b in lm.PLOT_RECIPES.items()
        for i, m in enumerate(lm.METHODS)
    ]
    path, png = tmp_path / "lm_results.json", tmp_path / "bpc.png"
    path.write_text(
        json.dumps({"float": {"val_bpc": 2.0, "file_bytes": 40}, "control": {"val_bpc": 1.9}, "rows": rows})
    )
    results = lm.main(["--results", str(path), "--plot", str(png)])
    assert results["targets"]["w2a16_g32 file / float"] == 0.25
    printed = capsys.readouterr().out
    assert "| w3a16_g32 | gptq | 3.0300 | +51.50% | yes | 10 | 25.0% |" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    with pytest.raises(SystemExit):
        lm.main(["--preset", "smoke"])  # no --out


def test_targets_and_table_from_hand_made_results():
    row = lambda recipe, method, bpc, size: {  # noqa: E731
        "recipe": recipe, "method": method, "val_bpc": bpc, "converted_val_bpc": bpc, "file_bytes": size
    }  # fmt: skip
    results = {
        "float": {"val_bpc": 2.0, "file_bytes": 1000},
        "control": {"val_bpc": 1.9},
        "rows": [
            row("w3a16_g32", "rtn", 2.5, 150),
            row("w3a16_g32", "gptq", 2.2, 150),
            row("w3a16_g32", "qat", 2.1, 150),
            row("w3a16_g32", "ptq_qat", 2.05, 150),
            row("w3a16_g32", "qad", 2.3, 150),
        ],
    }
    figures = lm.targets(results)
    assert figures == pytest.approx(
        {
            "w3a16_g32 rtn / float - 1": 0.25,
            "w3a16_g32 file / float": 0.15,
            "w3a16_g32 qat recovery": 0.4 / 0.6,  # (2.5 - 2.1) / (2.5 - 1.9)
            "w3a16_g32 ptq_qat recovery": 0.45 / 0.6,
            "w3a16_g32 qad recovery": 0.2 / 0.6,
            "w3a16_g32 best qat recovery": 0.45 / 0.6,
            "w3a16_g32 best qat - best ptq": 2.05 - 2.2,
            "w3a16_g32 gptq recovery": 0.3 / 0.5,  # (2.5 - 2.2) / (2.5 - 2.0)
            "w3a16_g32 best ptq recovery": 0.3 / 0.5,  # the best of the PTQ rows but rtn: gptq's
        }
    )
    lines = lm.table(results).splitlines()
    assert len(lines) == 4 + 5
    assert lines[-3] == "| w3a16_g32 | qat | 2.1000 | +5.00% | yes | 150 | 15.0% |"


def test_pareto_results_recompute_their_targets_print_and_plot(tmp_path, capsys):
    """`lm_pareto.py --results` on the stored full run: the targets recomputed from its rows are the stored ones,
    and by hand from the table's figures."""
    lm_pareto = importlib.import_module("lm_pareto")
    stored = BENCHMARKS / "results" / "lm_pareto_full.json"
    results = json.loads(stored.read_text())
    assert lm_pareto.targets(results) == results["targets"]
    bpc = {row["name"]: row["rtn_bpc"] for row in results["rows"]}
    w4, w3, w2 = bpc["W4 g32"], bpc["W3 g32"], bpc["W2 g32"]
    by_hand = (w2 - bpc["auto measured 2.5"]) / (w2 - w3)
    assert math.isclose(results["targets"]["w2_w3_gap_closed_measured"], by_hand, rel_tol=1e-12)
    assert math.isclose(results["targets"]["w3_w4_gap_closed_hessian"], (w3 - bpc["auto hessian 3"]) / (w3 - w4))
    lm_pareto.main(["--results", str(stored), "--plot", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert "auto measured 2.5" in out and "w2_w3_gap_closed" in out
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_calibration_seed_draws_other_batches_from_the_same_float_model():
    bench = lm.prepare(lm.PRESETS["smoke"], progress=False)
    with_seed = lambda seed: dataclasses.replace(bench, preset=dataclasses.replace(bench.preset, calibration_seed=seed))  # noqa: E731
    default, same, other = (lm.calibration_batches(b) for b in (bench, with_seed(bench.preset.seed + 2), with_seed(7)))
    assert len(other) == bench.preset.calibration_batches
    assert all(np.array_equal(a, b) for a, b in zip(default, same, strict=True))
    assert not any(np.array_equal(a, b) for a, b in zip(default, other, strict=True))
    # The float model (its cache entry) does not depend on it.
    describe = lambda b: lm._cache_description(b.preset, b.corpus)  # noqa: E731
    assert describe(with_seed(7)) == describe(bench)
    with pytest.raises(ValueError, match="`steps` must be >= 1"):
        dataclasses.replace(bench.preset, steps=0)
    dataclasses.replace(bench.preset, calibration_seed=0)  # a seed may be 0
