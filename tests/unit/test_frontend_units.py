"""Frontend pieces on their own: incremental detokenization, stop strings, the adapter registry, request params."""

from __future__ import annotations

import asyncio
import os

import pytest
from loraplex.frontend.adapters.registry import AdapterEntry, AdapterError, AdapterRegistry
from loraplex.frontend.detokenizer import IncrementalDetokenizer, StopMatcher, text_offsets
from loraplex.frontend.errors import InputError
from loraplex.frontend.params import NativeSamplingParams, native_sampling
from transformers import AutoTokenizer


@pytest.fixture(scope="module")
def tokenizer(llama_dir):
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.mark.parametrize("text", ["Hello world, how are you?", "naïve café — 東京 🚀🎉 ok", "a  b\n\tc 123.45"])
def test_incremental_detokenization_matches_full_decode_and_never_splits_utf8(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_offsets_cut_the_decoded_text_into_each_token_s_piece(tokenizer, skip_special_tokens):
    # completions' text_offset: with the BOS skipped it spans nothing; a character of several byte tokens lies in
    # the span of the token that completes it, the tokens before spanning nothing
    text = "Hi café 東京!"
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    decoded = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert decoded == ("" if skip_special_tokens else "<s>") + text
    offsets = text_offsets(tokenizer, ids, skip_special_tokens)
    pieces = [decoded[a:b] for a, b in zip(offsets, [*offsets[1:], len(decoded)], strict=True)]
    assert "".join(pieces) == decoded
    assert pieces[0] == ("" if skip_special_tokens else "<s>")
    for token_id, piece in zip(ids[1:], pieces[1:], strict=True):
        token = tokenizer.decode([token_id])
        assert piece == token or ("\ufffd" in token and piece in ("", "é", "東", "京")), (token, piece)
    assert [p for p in pieces if p in ("é", "東", "京")] == ["é", "東", "京"]


def test_stop_matcher_finds_earliest_and_holds_back_prefixes():
    m = StopMatcher(["END", "xy"])
    assert m.find("abc xy and END", 0) == (4, "xy")
    assert m.find("abcEN", 3) is None
    assert m.safe_len("abcEN") == 3  # "EN" could still become "END"
    assert m.safe_len("abcx") == 3
    assert m.safe_len("abc") == 3
    assert StopMatcher([]).safe_len("anything") == 8


def test_sampling_params_validation():
    sampling, stops = native_sampling(NativeSamplingParams(max_new_tokens=5, stop="x", temperature=0), [2, 4])
    assert sampling.stop_token_ids == [2, 4] and stops == ["x"]
    sampling, _ = native_sampling(NativeSamplingParams(ignore_eos=True, stop_token_ids=[7]), [2])
    assert sampling.stop_token_ids == [7]
    for bad in (dict(max_new_tokens=-1), dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2)):
        with pytest.raises(InputError):
            native_sampling(NativeSamplingParams(**bad), [])


def test_registry_holds_and_unload(tmp_path):
    async def scenario():
        registry = AdapterRegistry()
        registry.add(AdapterEntry(name="a", path="/p", lora_id=registry.mint_id()))
        entry = registry.acquire("a", "r1")
        assert not entry.released.is_set()
        with pytest.raises(AdapterError, match="has already been loaded"):
            registry.check_name("a")
        registry.begin_unload("a")
        with pytest.raises(AdapterError, match="being unloaded"):
            registry.acquire("a", "r2")
        registry.release(entry.lora_id, "r1")
        assert entry.released.is_set() and registry.total_holds() == 0
        registry.forget(entry)
        assert registry.get("a") is None and registry.num_entries() == 0
        with pytest.raises(AdapterError) as err:
            registry.acquire("a", "r3")
        assert err.value.kind == "not_found"
        assert registry.mint_id() == 1  # ids never reused

    asyncio.run(scenario())


def test_registry_in_place_reload_keeps_old_weights_for_holders():
    async def scenario():
        registry = AdapterRegistry()
        old = AdapterEntry(name="a", path="/p1", lora_id=registry.mint_id())
        registry.add(old)
        registry.acquire("a", "r1")
        new = AdapterEntry(name="a", path="/p2", lora_id=registry.mint_id())
        assert registry.add(new) is old
        assert registry.acquire("a", "r2").lora_id == new.lora_id
        assert old.draining and not old.released.is_set()

    asyncio.run(scenario())


@pytest.mark.parametrize("name", ["", "a:b", "../x", " ", "x" * 200, 5])
def test_registry_rejects_bad_names(name):
    with pytest.raises(AdapterError):
        AdapterRegistry().check_name(name)


def test_registry_confines_paths(tmp_path):
    root = tmp_path / "root"
    (root / "ok").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, root / "escape")
    registry = AdapterRegistry(str(root))
    assert registry.check_path("a", str(root / "ok")) == str((root / "ok").resolve())
    for path, kind in [(str(root / "ok" / ".." / ".." / "outside"), "forbidden"), (str(root / "escape"), "forbidden"),
                       (str(outside), "forbidden"), (str(root / "missing"), "not_found")]:
        with pytest.raises(AdapterError) as err:
            registry.check_path("a", path)
        assert err.value.kind == kind, path


def test_lora_scale_and_mix_bodies_are_checked():
    from loraplex.frontend.adapters.mixes import parse_mix
    from loraplex.frontend.adapters.strength import item_scales
    from loraplex.frontend.entrypoints.engine import Engine
    from loraplex.frontend.params import LoRAMixBody
    from loraplex.protocol.errors import ServerError

    assert item_scales([None, 0, 4, 0.5], [None, "a", "a", "b"]) == [1.0, 0.0, 4.0, 0.5]
    for scale, name in ((4.01, "a"), (-1, "a"), (True, "a"), (float("nan"), "a"), (0.5, None)):
        with pytest.raises(ServerError) as refused:
            item_scales([scale], [name])
        assert refused.value.kind == "invalid_lora_scale" and "lora_scale" in str(refused.value)
    mix = parse_mix({"adapters": {"a": 0.7, "b": 0.3}, "merge": "ties", "density": 0.5, "seed": 1})
    assert mix.weights == (("a", 0.7), ("b", 0.3)) and mix.name.startswith("mix-")
    # one mix, one name; any change of weight, order, merge, density or seed is another mix
    same = parse_mix({"seed": 1, "density": 0.5, "merge": "ties", "adapters": {"a": 0.7, "b": 0.3}})
    other = parse_mix({"adapters": {"a": 0.7, "b": 0.3}, "merge": "ties", "density": 0.5, "seed": 2})
    assert same.name == mix.name != other.name
    assert parse_mix({"adapters": {"a": 1}}).merge == "linear"
    for bad in ({"adapters": {}}, {"adapters": {"a": "x"}}, {"adapters": {"a": 1}, "merge": "cat"},
                {"adapters": {"a": 1}, "merge": "dare_linear"}, {"adapters": {"a": 1}, "seed": -1},
                {"adapters": {"a": 1}, "rank": 4}, ["a"]):  # fmt: skip
        with pytest.raises(ServerError) as refused:
            parse_mix(bad)
        assert refused.value.kind == "invalid_lora_mix"
    body = Engine._body("x", None, {"adapters": {"a": 1.0}}, None, None, False, {}, 0.5)
    assert isinstance(body.lora_path, LoRAMixBody) and body.lora_scale == 0.5
