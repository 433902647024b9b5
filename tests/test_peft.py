"""PEFT adapters as --update-path factors, with real peft on models built from configs.

What users care about: a merged LoRA (merge_and_unload) of BERT (Linear) or GPT-2
(Conv1D, fan_in_fan_out) is stored as its factors plus a correction of almost nothing
(at most 1.2x the adapter file), whatever alpha_pattern / rank_pattern / rsLoRA the
adapter used, from a safetensors or a .bin adapter or its directory; checkouts are bit
for bit; what cannot be stored as factors (DoRA, factors that do not fit) says so.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import git, sha256
from st_files import st_from_arrays

from git_theta.errors import ObjectCorruptError
from git_theta.updates import UPDATES
from git_theta.updates.factored import Factor, Inputs, apply_update, load_factors, reproduce

MODEL = "model.safetensors"


def build(family: str) -> tuple[Any, list[str]]:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    if family == "bert":
        config = tf.BertConfig(
            vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=128, max_position_embeddings=64,
        )  # fmt: skip
        return tf.BertForMaskedLM(config), ["query", "value"]
    config = tf.GPT2Config(vocab_size=100, n_embd=64, n_layer=2, n_head=2, n_positions=64)
    return tf.GPT2LMHeadModel(config), ["c_attn", "c_proj"]


def train(model: Any, steps: int = 2) -> None:
    import torch

    gen = torch.Generator().manual_seed(1)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        ids = torch.randint(0, 100, (2, 16), generator=gen)
        model(input_ids=ids, labels=ids).loss.backward()
        optim.step()
        optim.zero_grad()


Case = tuple[Path, Path, Path]  # base model file, merged model file, adapter directory


@pytest.fixture(scope="module")
def make_case(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Case]]:
    """Build (once per module and arguments) a base model, a trained LoRA and the merge."""
    made: dict[str, Case] = {}

    def make(family: str, safe: bool = True, **lora: Any) -> Case:
        key = json.dumps([family, safe, lora], sort_keys=True)
        if key not in made:
            import peft

            out = tmp_path_factory.mktemp("peft")
            model, targets = build(family)
            model.save_pretrained(out / "v0")
            kind = lora.pop("kind", "lora")
            if kind == "ia3":
                config: Any = peft.IA3Config(target_modules=targets, feedforward_modules=[], **lora)
            else:
                config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, **lora)
            wrapped = peft.get_peft_model(model, config)
            if kind == "ia3":  # IA3 starts at ones: give it a change to store
                import torch

                with torch.no_grad():
                    for name, p in wrapped.named_parameters():
                        if "ia3_l" in name:
                            p.mul_(1 + 0.1 * torch.randn(p.shape))
            else:
                train(wrapped)
            wrapped.save_pretrained(out / "adapter", safe_serialization=safe)
            wrapped.merge_and_unload().save_pretrained(out / "v1")
            made[key] = (out / "v0" / MODEL, out / "v1" / MODEL, out / "adapter")
        return made[key]

    import os

    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    yield make
    if old is None:
        os.environ.pop("HF_HUB_OFFLINE", None)
    else:
        os.environ["HF_HUB_OFFLINE"] = old


def add(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["git", "theta", "add", *args, MODEL], cwd=repo, capture_output=True, text=True
    )


def commit_merge(repo: Path, case: Case, kind: str = "low-rank", path: str = "") -> str:
    """Commit the base, then the merge added with its factors; return add's stderr."""
    base, merged, adapter = case
    (repo / MODEL).write_bytes(base.read_bytes())
    git(repo, "add", MODEL)
    git(repo, "commit", "-q", "-m", "base")
    (repo / MODEL).write_bytes(merged.read_bytes())
    done = add(repo, "--update-type", kind, "--update-path", path or str(adapter))
    assert done.returncode == 0, done.stderr
    git(repo, "commit", "-q", "-m", "merged")
    assert git(repo, "status", "--porcelain").stdout == b""
    (repo / MODEL).unlink()
    git(repo, "checkout", "--", MODEL)
    assert sha256(repo / MODEL) == sha256(merged)
    return done.stderr


def links(repo: Path, kind: str) -> dict[str, int]:
    """Tensor name -> size of its ``kind`` link, for the tensors HEAD stores that way."""
    manifest = json.loads(git(repo, "show", f"HEAD:{MODEL}").stdout)
    out = {}
    for name, entry in manifest["tensors"].items():
        last = entry["chain"][-1]
        if last["update"] == kind:
            out[name] = last["size"]
    return out


def adapter_file(adapter: Path) -> Path:
    return next(adapter.glob("adapter_model.*"))


@pytest.mark.parametrize(
    ("family", "lora", "targets"),
    [
        ("gpt2", {}, 6),  # Conv1D: fan_in_fan_out; c_proj is in attn and mlp
        ("bert", {"alpha_pattern": {"value": 64}, "rank_pattern": {"query": 4}}, 4),
        pytest.param("bert", {"use_rslora": True}, 4, marks=pytest.mark.slow),
    ],
    ids=["gpt2-conv1d", "bert-alpha-rank-pattern", "bert-rslora"],
)
def test_merged_lora_costs_at_most_its_factors(
    repo: Path, make_case: Callable[..., Case], family: str, lora: dict[str, Any], targets: int
) -> None:
    case = make_case(family, **lora)
    stderr = commit_merge(repo, case)
    stored = links(repo, "low-rank")
    assert len(stored) == targets, stderr
    assert stderr.count("reproduce the file within 0 (max abs)") == targets, stderr
    assert sum(stored.values()) <= 1.2 * adapter_file(case[2]).stat().st_size


@pytest.mark.slow  # the default run covers the same path with the tests above
def test_bin_adapter_and_its_directory(repo: Path, make_case: Callable[..., Case]) -> None:
    """A .bin adapter (torch zip) is read without torch.load, from its directory."""
    case = make_case("gpt2", safe=False)
    assert adapter_file(case[2]).name == "adapter_model.bin"
    commit_merge(repo, case)
    assert sum(links(repo, "low-rank").values()) <= 1.2 * adapter_file(case[2]).stat().st_size


@pytest.mark.slow  # the default run covers the same path with the tests above
def test_peft_ia3_merge(repo: Path, make_case: Callable[..., Case]) -> None:
    case = make_case("bert", kind="ia3")
    commit_merge(repo, case, "ia3")
    stored = links(repo, "ia3")  # biases (scaled too) are smaller stored dense
    layers = "bert.encoder.layer"
    assert set(stored) == {
        f"{layers}.{n}.attention.self.{m}.weight" for n in (0, 1) for m in ("query", "value")
    }


def test_dora_is_refused_with_one_line(repo: Path, make_case: Callable[..., Case]) -> None:
    case = make_case("bert", use_dora=True)
    stderr = commit_merge(repo, case)
    assert links(repo, "low-rank") == {}
    lines = [line for line in stderr.splitlines() if "DoRA" in line]
    assert len(lines) == 4
    assert lines[0].startswith("git-theta: bert.encoder.layer.")
    assert lines[0].endswith(
        "DoRA adapters are not stored as factors (the merge divides by the merged "
        "weight's norm); stored as auto would"
    )


@pytest.mark.slow  # the default run covers the same path with the tests above
def test_named_adapters_in_one_file(
    repo: Path, tmp_path: Path, make_case: Callable[..., Case]
) -> None:
    """A PeftModel's own state dict holds every adapter by name; the one merged is found."""
    import peft
    from safetensors.torch import save_file

    base = make_case("bert")[0]
    model, targets = build("bert")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
    wrapped.add_adapter("other", peft.LoraConfig(r=8, lora_alpha=32, target_modules=targets))
    wrapped.set_adapter("other")
    train(wrapped)
    lora = {k: v.contiguous() for k, v in wrapped.state_dict().items() if ".lora_" in k}
    assert any(".lora_A.other." in k for k in lora) and any(".lora_A.default." in k for k in lora)
    both = tmp_path / "both"
    both.mkdir()
    save_file(lora, str(both / "adapters.safetensors"))
    (both / "adapter_config.json").write_text(
        json.dumps({"default": {"lora_alpha": 8}, "other": {"lora_alpha": 32}})
    )
    merged = tmp_path / "merged"
    wrapped.merge_and_unload().save_pretrained(merged)
    commit_merge(repo, (base, merged / MODEL, both), path=str(both / "adapters.safetensors"))
    stored = links(repo, "low-rank")
    assert len(stored) == 4
    assert sum(stored.values()) < 0.6 * (both / "adapters.safetensors").stat().st_size


def test_conv_lora_and_stacked_factors(repo: Path, tmp_path: Path) -> None:
    """Beyond 2-D: PEFT's Conv2d LoRA changes the kernel viewed as (out, in*kh*kw);
    factors of 3+ dimensions are a stack of matrices, as the predecessor applied them."""
    import peft
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3), torch.nn.Conv2d(32, 32, 1))
    base = {k: v.detach().clone().contiguous() for k, v in net.state_dict().items()}
    stack = (np.random.default_rng(3).standard_normal((2, 64, 48)) * 0.1).astype(np.float32)
    r = (np.random.default_rng(4).standard_normal((2, 64, 2)) * 0.1).astype(np.float32)
    c = (np.random.default_rng(5).standard_normal((2, 2, 48)) * 0.1).astype(np.float32)
    save_file({**base, "stack": torch.from_numpy(stack)}, str(repo / MODEL))
    git(repo, "add", MODEL)
    git(repo, "commit", "-q", "-m", "base")

    wrapped = peft.get_peft_model(net, peft.LoraConfig(r=2, target_modules=["0", "1"]))
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    adapter = tmp_path / "adapter"
    wrapped.save_pretrained(adapter)
    merged = {k: v.contiguous() for k, v in wrapped.merge_and_unload().state_dict().items()}
    merged["stack"] = torch.from_numpy(stack)
    save_file(merged, str(repo / MODEL))
    done = add(repo, "--update-type", "low-rank", "--update-path", str(adapter))
    assert done.returncode == 0, done.stderr
    git(repo, "commit", "-q", "-m", "conv")
    assert set(links(repo, "low-rank")) == {"0.weight", "1.weight"}
    merged["stack"] = torch.from_numpy(stack + r @ c)  # NumPy's stacked matmul
    save_file(merged, str(repo / MODEL))
    extra = tmp_path / "stack.safetensors"
    save_file({"stack/R": torch.from_numpy(r), "stack/C": torch.from_numpy(c)}, str(extra))
    want = sha256(repo / MODEL)
    done = add(repo, "--update-type", "low-rank", "--update-path", str(extra))
    assert done.returncode == 0, done.stderr
    git(repo, "commit", "-q", "-m", "stack")
    assert "stack" in links(repo, "low-rank")
    (repo / MODEL).unlink()
    git(repo, "checkout", "--", MODEL)
    assert sha256(repo / MODEL) == want


def test_torch_and_npz_factor_files(repo: Path, tmp_path: Path) -> None:
    import torch

    rng = np.random.default_rng(7)
    w = (rng.standard_normal((48, 32)) * 0.02).astype(np.float32)
    r = (rng.standard_normal((48, 4)) * 0.01).astype(np.float32)
    c = (rng.standard_normal((4, 32)) * 0.01).astype(np.float32)
    (repo / MODEL).write_bytes(st_from_arrays({"w": w}))
    git(repo, "add", MODEL)
    git(repo, "commit", "-q", "-m", "base")
    for number, suffix in enumerate((".pt", ".npz")):
        path = tmp_path / f"factors{suffix}"
        scaled = r * np.float32(number + 2)
        if suffix == ".pt":
            torch.save({"w/R": torch.from_numpy(scaled), "w/C": torch.from_numpy(c)}, path)
        else:
            np.savez(path, **{"w/R": scaled, "w/C": c})
        w = w + scaled @ c
        (repo / MODEL).write_bytes(st_from_arrays({"w": w}))
        done = add(repo, "--update-type", "low-rank", "--update-path", str(path))
        assert done.returncode == 0, done.stderr
        assert "git-theta: w: low-rank factors reproduce the file within 0 (max abs)" in done.stderr
        git(repo, "commit", "-q", "-m", suffix)
        assert links(repo, "low-rank")["w"] < 1.2 * (r.nbytes + c.nbytes)


def test_factor_file_errors_name_the_factors_file(repo: Path, tmp_path: Path) -> None:
    (repo / MODEL).write_bytes(st_from_arrays({"w": np.ones((4, 4), np.float32)}))
    bad = tmp_path / "adapter.pt"
    bad.write_bytes(b"PK\x03\x04" + b"\x00" * 60)
    done = add(repo, "--update-type", "low-rank", "--update-path", str(bad))
    assert done.returncode != 0
    assert done.stderr.splitlines()[0] == (  # then git's own "clean filter failed"
        f"git-theta: error: {MODEL}: --update-path {bad}: not a checkpoint in a known format "
        "(known: flax, gguf, hdf5, npy, npz, rawf32, safetensors, torch)"
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    done = add(repo, "--update-type", "low-rank", "--update-path", str(empty))
    assert done.returncode != 0
    assert done.stderr.splitlines()[0] == (
        f"git-theta: error: {MODEL}: --update-path {empty}: a directory without "
        "adapter_model.safetensors or adapter_model.bin; give the factors file itself"
    )
    compressed = tmp_path / "c.npz"
    np.savez_compressed(compressed, **{"w/R": np.ones((4, 1), np.float32)})
    done = add(repo, "--update-type", "low-rank", "--update-path", str(compressed))
    assert done.returncode != 0
    assert "savez_compressed" in done.stderr, done.stderr


def test_factors_that_do_not_fit_say_so(repo: Path, tmp_path: Path) -> None:
    w = np.ones((6, 4), np.float32)
    (repo / MODEL).write_bytes(st_from_arrays({"w": w}))
    git(repo, "add", MODEL)
    git(repo, "commit", "-q", "-m", "base")
    (repo / MODEL).write_bytes(st_from_arrays({"w": w * 2}))
    factors = tmp_path / "f.safetensors"
    r, c = np.ones((5, 2), np.float32), np.ones((2, 4), np.float32)
    factors.write_bytes(st_from_arrays({"w/R": r, "w/C": c}))
    done = add(repo, "--update-type", "low-rank", "--update-path", str(factors))
    assert done.returncode == 0, done.stderr
    assert done.stderr.splitlines()[0] == (
        "git-theta: warning: w: low-rank factors [5, 2] x [2, 4] do not fit the tensor "
        "[6, 4] F32; stored as auto would"
    )  # then the filter's summary of tensors stored dense


def test_apply_update_is_torch_merge(make_case: Callable[..., Case]) -> None:
    """The side-load function: previous + update, computed as peft merges (for
    ``--update-data``); on this machine's torch it gives merge_and_unload's bits."""
    from safetensors.numpy import load_file

    base, merged, adapter = make_case("gpt2")
    before, after = load_file(str(base)), load_file(str(merged))
    found = load_factors(str(adapter))
    checked = 0
    for name, candidates in found.candidates.items():
        if name not in before:
            continue
        prev = before[name]
        value = apply_update(prev.tobytes(), "F32", prev.shape, candidates)
        got = np.frombuffer(value, np.float32)
        assert np.mean(got != after[name].reshape(-1)) < 1e-3, name
        checked += 1
    assert checked == 6
    with pytest.raises(Exception, match=r"do not fit a tensor of F32 \[3, 3\]"):
        apply_update(np.ones(9, np.float32).tobytes(), "F32", (3, 3), found.candidates[name])


def test_new_payload_keys_are_checked() -> None:
    rng = np.random.default_rng(9)
    prev = (rng.standard_normal((16, 12)) * 0.02).astype(np.float32)
    b = Factor("F32", (12, 4), (rng.standard_normal((12, 4)) * 0.01).astype(np.float32).tobytes())
    a = Factor("F32", (4, 16), (rng.standard_normal((4, 16)) * 0.3).astype(np.float32).tobytes())
    inputs = Inputs("low-rank", (b, a), 2.0, transpose=True, rounding="steps")
    new = reproduce(prev.tobytes(), "F32", (16, 12), inputs)
    assert new is not None
    assert new != reproduce(prev.tobytes(), "F32", (16, 12), inputs._replace(rounding="f64"))
    plugin = UPDATES.get("low-rank")
    _, parts = type(plugin)({"t": inputs}).pick(  # type: ignore[call-arg]
        new, prev.tobytes(), "F32", lambda: [], None, "t", (16, 12)
    )
    assert parts is not None
    payload = b"".join(parts)
    assert bytes(plugin.apply(bytearray(prev.tobytes()), payload, "F32")) == new
    for old, bad in ((b'"rounding": "steps"', b'"rounding": "other"'), (b"true", b"1   ")):
        assert old in payload
        with pytest.raises(ObjectCorruptError, match="header is malformed"):
            plugin.apply(bytearray(prev.tobytes()), payload.replace(old, bad), "F32")


def _nearest_f32(exact: Fraction) -> np.float32:
    """``exact`` rounded to float32, to nearest, ties to even (the reference)."""
    guess = np.float32(float(exact))
    best = None
    for cand in (np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.inf)):
        cand = np.float32(cand)
        distance = abs(Fraction(float(cand)) - exact)
        even = int(np.array(cand).view(np.uint32)) % 2 == 0
        key = (distance, not even)
        if best is None or key < best[0]:
            best = (key, cand)
    assert best is not None
    return best[1]


def test_fused_multiply_add_rounds_once() -> None:
    """The 'steps' rounding's float32 FMA: exact where float64 alone would round twice
    (a sum just off a float32 tie), and on random sums, against exact rationals."""
    from git_theta.updates.factored import _round32

    rng = np.random.default_rng(11)
    x = rng.standard_normal(200).astype(np.float32)
    tie = (x.astype(np.float64) + np.nextafter(x, np.float32(np.inf)).astype(np.float64)) / 2
    tiny = np.float32(1e-30) * np.where(rng.random(200) < 0.5, 1, -1).astype(np.float32)
    a = np.concatenate([tie, rng.standard_normal(300) * 1e-3, np.full(4, 1e-42)])
    b = np.concatenate([tiny, rng.standard_normal(300).astype(np.float32), np.zeros(4)])
    b = b.astype(np.float32).astype(np.float64)
    got = _round32(a, b)
    exact = [Fraction(float(p)) + Fraction(float(q)) for p, q in zip(a, b, strict=True)]
    want = [_nearest_f32(value) for value in exact]
    assert np.array_equal(got.astype(np.float32), np.array(want, np.float32))
    naive = (a + b).astype(np.float32)  # double rounding: wrong on about half the ties
    assert np.count_nonzero(naive[:200] != got[:200].astype(np.float32)) > 50


def test_side_load_api_applies_predecessor_shapes(tmp_path: Path) -> None:
    """What --update-data calls: ia3 vectors keep their dimensions ((1, n) scales the
    columns even of a square tensor; (out, 1, 1, 1) a conv kernel's filters), stacked
    low-rank factors change each matrix of a stack; names match across a prefix."""
    from git_theta.updates.factored import candidates_for

    rng = np.random.default_rng(5)
    square = rng.standard_normal((4, 4)).astype(np.float32)
    kernel = rng.standard_normal((3, 2, 2, 2)).astype(np.float32)
    stack = rng.standard_normal((2, 3, 4)).astype(np.float32)
    cols = (1 + rng.standard_normal((1, 4))).astype(np.float32)
    filters = (1 + rng.standard_normal((3, 1, 1, 1))).astype(np.float32)
    r = rng.standard_normal((2, 3, 1)).astype(np.float32)
    c = rng.standard_normal((2, 1, 4)).astype(np.float32)
    path = tmp_path / "update.safetensors"
    path.write_bytes(
        st_from_arrays({"model.sq/ia3": cols, "conv/ia3": filters, "stack/R": r, "stack/C": c})
    )
    found = load_factors(str(path))
    for name, prev, want in (
        ("sq", square, square * cols),
        ("conv", kernel, kernel * filters),
        ("stack", stack, stack + r @ c),
    ):
        _, options = candidates_for(found.candidates, name)
        assert options, name
        got = apply_update(prev.tobytes(), "F32", prev.shape, options)
        assert np.array_equal(np.frombuffer(got, np.float32), want.reshape(-1)), name
    assert candidates_for(found.candidates, "sq")[0] == "model.sq/ia3"[: -len("/ia3")]
    assert candidates_for(found.candidates, "missing") == ("missing", [])


# A low-rank object of the second definition (transpose, rounding "steps", a non-empty
# correction), written once: it must decode to the same bytes forever, whatever the encoder.
_PINNED_PREV = (
    "yst3O1FLK7xIWge8SAFIvZluEz3Mdbs85ETVu5qPfTxSS7g7B3o1vCcqoDy+hsu7f3/XuwvJgbymFBU8WAUCuyKu"
    "Mjxu9ka8XTwmO7AwkryZ3Yk8G3Z2O52k2DuQgwY8"
)
_PINNED_PAYLOAD = (
    "R1RGWMYAAAB7ImZhY3RvcnMiOiBbeyJkdHlwZSI6ICJGMzIiLCAic2hhcGUiOiBbNCwgMl0sICJzaXplIjogNzJ9"
    "LCB7ImR0eXBlIjogIkYzMiIsICJzaGFwZSI6IFsyLCA2XSwgInNpemUiOiA4OH1dLCAia2luZCI6ICJsb3ctcmFu"
    "ayIsICJyb3VuZGluZyI6ICJzdGVwcyIsICJzY2FsZSI6IDIuMCwgInNoYXBlIjogWzYsIDRdLCAidHJhbnNwb3Nl"
    "IjogdHJ1ZX1HVEhPAQQBACAAAAAAAAAAAAAQAAAIAAAAeHh5eXl4eHUACAAAAEsAUAwb7RNRAAgAAAA0ofhxWBq6"
    "awAIAAAAffxeQ8dpsJ5HVEhPAQQBADAAAAAAAAAAAAAQAAAMAAAAfXx7e3p9fXx7fnx9AAwAAABLuwJdoQpbAyoU"
    "1UsADAAAAETcwAY0ygwwhbKvfAAMAAAATI4qrBN+e6n0wNHFR1RITwEEAABgAAAAAAAAAAAAEAAAGAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAAAAAAAAAAAAYAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAABgAAAAAAAAAAAAAAAAAAAAA"
    "AAAAAAAAAAAAAAAAGAAAAAIAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=="
)
_PINNED_NEW = "0917cef7e08c77fa15808abc92148d87abbc05e2dd2be37bbdff97dd3d15736a"


def test_pinned_steps_object_still_decodes() -> None:
    import base64
    import hashlib

    prev = bytearray(base64.b64decode(_PINNED_PREV))
    payload = base64.b64decode(_PINNED_PAYLOAD)
    value = UPDATES.get("low-rank").apply(prev, payload, "F32")
    assert hashlib.sha256(bytes(value)).hexdigest() == _PINNED_NEW
