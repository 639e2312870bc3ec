"""Sampling: what the edges accept or refuse by name (core.sampling) and what the engine's sampler
draws (engines.sampling)."""

from __future__ import annotations

import pytest
import torch

from mm_encoder.core.errors import BadRequest
from mm_encoder.core.sampling import SamplingParams
from mm_encoder.engines.sampling import Sampler, token_logprobs

EOS = 7


def _refused(request: dict, field: str, code: str = "unsupported_field") -> BadRequest:
    with pytest.raises(BadRequest) as info:
        SamplingParams.from_openai(request)
    assert info.value.code == code
    assert f"`{field}`" in info.value.message
    return info.value


# --- the OpenAI edge -------------------------------------------------------------------------


def test_no_sampling_fields_is_greedy():
    p = SamplingParams.from_openai({"model": "m", "messages": []})
    assert p == SamplingParams() and p.greedy and p.to_dict() == {}


@pytest.mark.parametrize("request_, field", [
    ({"n": 2}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"use_beam_search": True}, "use_beam_search"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"guided_json": {"type": "object"}}, "guided_json"),
    ({"nvext": {"guided_regex": "a+"}}, "nvext.guided_regex"),
])
def test_openai_refuses_what_it_cannot_honour(request_, field):
    _refused(request_, field)


def test_refusal_message_says_why():
    assert _refused({"n": 2}, "n").message == "`n`=2 is not supported: this engine returns one choice"
    assert _refused({"prompt_logprobs": 0}, "prompt_logprobs").message == (
        "`prompt_logprobs`=0 is not supported: this engine returns logprobs of generated tokens only")


def test_logprobs_and_top_logprobs_are_honoured_within_openais_bounds():
    p = SamplingParams.from_openai({"logprobs": True, "top_logprobs": 20})
    assert (p.logprobs, p.top_logprobs) == (True, 20) and p.greedy
    assert p.to_dict() == {"logprobs": True, "top_logprobs": 20} and SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_openai({"logprobs": True}).to_dict() == {"logprobs": True}  # the chosen token's only
    assert _refused({"logprobs": True, "top_logprobs": 21}, "top_logprobs", code="bad_request").message == (
        "invalid sampling parameters: `top_logprobs`: Input should be less than or equal to 20")
    _refused({"logprobs": True, "top_logprobs": -1}, "top_logprobs", code="bad_request")
    _refused({"logprobs": "yes"}, "logprobs", code="bad_request")
    with pytest.raises(BadRequest, match="top_logprobs needs logprobs: true") as info:
        SamplingParams.from_openai({"top_logprobs": 2})
    assert info.value.code == "bad_request"


@pytest.mark.parametrize("harmless", [
    {"n": 1, "best_of": None, "logprobs": False, "top_logprobs": None, "logit_bias": {}},
    {"tools": [], "tool_choice": "none", "functions": None, "parallel_tool_calls": True},
    {"response_format": {"type": "text"}, "guided_json": None, "use_beam_search": False},
])
def test_openai_accepts_fields_that_ask_for_nothing(harmless):
    assert SamplingParams.from_openai(harmless) == SamplingParams()


@pytest.mark.parametrize("request_, field", [
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"seed": "x"}, "seed"),
    ({"stop": [f"s{i}" for i in range(20)]}, "stop"),
    ({"stop": ["ok", ""]}, "stop[1]"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"nvext": {"ignore_eos": "yes"}}, "nvext.ignore_eos"),
])
def test_openai_names_invalid_values(request_, field):
    err = _refused(request_, field, code="bad_request")
    assert err.http_status == 400


def test_every_invalid_field_is_listed_at_once():
    err = _refused({"temperature": -1, "presence_penalty": 3}, "temperature", code="bad_request")
    assert "`presence_penalty`" in err.message


def test_openai_reads_every_sampling_field():
    p = SamplingParams.from_openai({
        "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 123, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "repetition_penalty": 1.1, "stop": "\n\n", "stop_token_ids": [3, 4],
        "max_tokens": 99, "max_completion_tokens": 50, "min_tokens": 2, "ignore_eos": True,
    })
    assert p == SamplingParams(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=123, presence_penalty=0.5,
                               frequency_penalty=-0.5, repetition_penalty=1.1, stop=["\n\n"], stop_token_ids=[3, 4],
                               max_tokens=50, min_tokens=2, ignore_eos=True)
    assert not p.greedy


def test_stop_string_becomes_a_list():
    assert SamplingParams.from_openai({"stop": "END"}).stop == ["END"]
    assert SamplingParams.from_openai({"stop": ["a", "b"]}).stop == ["a", "b"]


def test_nvext_ignore_eos_and_greed_sampling():
    p = SamplingParams.from_openai({"temperature": 1.0, "nvext": {"ignore_eos": True, "greed_sampling": True}})
    assert p.ignore_eos and p.temperature == 0 and p.greedy
    assert SamplingParams.from_openai({"ignore_eos": False, "nvext": {"ignore_eos": True}}).ignore_eos is False


@pytest.mark.parametrize("top_k", [None, 0, -1])
def test_top_k_off_spellings(top_k):
    assert SamplingParams.from_openai({"top_k": top_k}).top_k is None


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(BadRequest, match="min_tokens=5 is above max_tokens=2"):
        SamplingParams.from_openai({"min_tokens": 5, "max_tokens": 2})


# --- the Dynamo edge and our own transport ----------------------------------------------------


DYNAMO = {
    "token_ids": [1, 2, 3],
    "stop_conditions": {"max_tokens": 64, "stop": ["</s>"], "stop_token_ids_hidden": [151645], "min_tokens": None,
                        "ignore_eos": None, "max_thinking_tokens": None},
    "sampling_options": {"n": None, "best_of": None, "presence_penalty": 0.3, "frequency_penalty": None,
                         "repetition_penalty": None, "temperature": 0.6, "top_p": 0.95, "top_k": -1, "min_p": None,
                         "use_beam_search": None, "length_penalty": None, "seed": 42,
                         "include_stop_str_in_output": None, "guided_decoding": None},
    "output_options": {"logprobs": None, "prompt_logprobs": None, "skip_special_tokens": True,
                       "formatted_prompt": None},
    "eos_token_ids": [151643],
    "annotations": [],
}


def test_from_dynamo_reads_a_preprocessed_request_and_round_trips():
    p = SamplingParams.from_dynamo(DYNAMO)
    assert p == SamplingParams(temperature=0.6, top_p=0.95, seed=42, presence_penalty=0.3, max_tokens=64,
                               stop=["</s>"], stop_token_ids=[151645])
    d = p.to_dict()
    assert d == {"temperature": 0.6, "top_p": 0.95, "seed": 42, "presence_penalty": 0.3, "max_tokens": 64,
                 "stop": ["</s>"], "stop_token_ids": [151645]}
    assert SamplingParams.from_dict(d) == p
    assert SamplingParams.from_dict(None) == SamplingParams()


def test_from_dynamo_ignores_new_keys_and_missing_sections():
    assert SamplingParams.from_dynamo({"token_ids": [1], "sampling_options": {"future_knob": 3}}) == SamplingParams()


@pytest.mark.parametrize("section, key, value, field", [
    ("sampling_options", "n", 2, "n"),
    ("sampling_options", "best_of", 2, "best_of"),
    ("sampling_options", "use_beam_search", True, "use_beam_search"),
    ("sampling_options", "guided_decoding", {"json": {}}, "guided_decoding"),
    ("sampling_options", "length_penalty", 0.5, "length_penalty"),
    ("output_options", "prompt_logprobs", 0, "prompt_logprobs"),
])
def test_from_dynamo_refuses_by_openai_name(section, key, value, field):
    request = {**DYNAMO, section: {**DYNAMO[section], key: value}}
    with pytest.raises(BadRequest) as info:
        SamplingParams.from_dynamo(request)
    assert info.value.code == "unsupported_field" and f"`{field}`" in info.value.message


@pytest.mark.parametrize("asked, top", [(0, 0), (3, 3), (20, 20)])
def test_from_dynamo_honours_logprobs_as_the_number_of_alternatives(asked, top):
    """Dynamo's `output_options.logprobs` is OpenAI's `top_logprobs` (0: the chosen token's only)."""
    p = SamplingParams.from_dynamo({**DYNAMO, "output_options": {**DYNAMO["output_options"], "logprobs": asked}})
    assert (p.logprobs, p.top_logprobs) == (True, top)


def test_from_dynamo_names_a_logprobs_count_out_of_bounds():
    with pytest.raises(BadRequest, match=r"`output_options\.logprobs`: Input should be less than or equal to 20"):
        SamplingParams.from_dynamo({"output_options": {"logprobs": 21}})


def test_from_dict_refuses_unknown_fields():
    with pytest.raises(BadRequest, match="`tempreature`"):
        SamplingParams.from_dict({"tempreature": 1.0})


# --- the engine's sampler --------------------------------------------------------------------


def _run(params: SamplingParams, steps: int = 20, vocab: int = 1000, logits_seed: int = 0) -> list[int]:
    """Tokens over `steps` draws from fixed random logits (the same for every call with `logits_seed`)."""
    g = torch.Generator().manual_seed(logits_seed)
    rows = torch.randn(steps, vocab, generator=g) * 0.1  # flat-ish: many tokens are plausible
    sampler = Sampler(params, [])
    return [sampler.next(row) for row in rows]


def test_greedy_is_argmax():
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1))
    assert Sampler(SamplingParams(), [EOS]).next(logits) == int(logits.argmax())
    assert Sampler(SamplingParams(temperature=0.0), [EOS]).next(logits) == int(logits.argmax())


def test_inference_mode_bf16_logits_are_fine_and_untouched():
    with torch.inference_mode():
        logits = torch.randn(300, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    before = logits.clone()
    Sampler(SamplingParams(temperature=1.0, top_p=0.5, min_p=0.1, top_k=10, seed=1), []).next(logits)
    assert torch.equal(logits, before)


def test_same_seed_same_tokens_different_seed_different_tokens():
    a = _run(SamplingParams(temperature=1.0, seed=1234))
    assert a == _run(SamplingParams(temperature=1.0, seed=1234))
    assert a != _run(SamplingParams(temperature=1.0, seed=1235))
    assert len(set(a)) > 10  # really sampling, not a constant


def test_no_seed_is_a_fresh_random_seed():
    assert Sampler(SamplingParams(temperature=1.0), []).seed != Sampler(SamplingParams(temperature=1.0), []).seed


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_top_k_1_is_greedy_at_any_temperature(temperature):
    greedy = _run(SamplingParams())
    assert _run(SamplingParams(temperature=temperature, top_k=1, seed=9)) == greedy


def test_tiny_top_p_keeps_only_the_max():
    greedy = _run(SamplingParams())
    assert _run(SamplingParams(temperature=2.0, top_p=1e-6, seed=3)) == greedy


def test_min_p_near_one_keeps_only_the_max():
    assert _run(SamplingParams(temperature=2.0, min_p=0.999, seed=3)) == _run(SamplingParams())


def test_top_k_restricts_draws_to_the_k_best():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(5))
    best = set(torch.topk(logits, 5).indices.tolist())
    sampler = Sampler(SamplingParams(temperature=2.0, top_k=5, seed=0), [])
    drawn = {sampler.next(logits) for _ in range(200)}
    assert drawn <= best and len(drawn) > 1


def _after(params: SamplingParams, history: list[int], logits: torch.Tensor) -> int:
    """The greedy token chosen once `history` has been generated."""
    sampler = Sampler(params, [])
    steer = torch.full_like(logits, -100.0)
    for t in history:  # steer the sampler into generating `history` first
        sampler.next(steer.index_fill(0, torch.tensor([t]), 100.0))
    assert sampler.generated == history
    return sampler.next(logits)


def test_presence_penalty_moves_the_argmax():
    logits = torch.tensor([0.0, 3.0, 2.5, 0.0])
    assert _after(SamplingParams(), [1], logits) == 1
    assert _after(SamplingParams(presence_penalty=1.0), [1], logits) == 2  # 3 - 1 < 2.5


def test_frequency_penalty_counts_repeats():
    logits = torch.tensor([0.0, 3.0, 2.5, 0.0])
    assert _after(SamplingParams(frequency_penalty=0.4), [1], logits) == 1  # 3 - 0.4 > 2.5
    assert _after(SamplingParams(frequency_penalty=0.4), [1, 1], logits) == 2  # 3 - 0.8 < 2.5


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    assert _after(SamplingParams(repetition_penalty=1.5), [1], torch.tensor([0.0, 3.0, 2.5])) == 2  # 3/1.5 < 2.5
    # a seen negative logit falls further: -1 * 3 = -3 < -2
    assert _after(SamplingParams(repetition_penalty=3.0), [0], torch.tensor([-1.0, -2.0, -5.0])) == 1


def test_min_tokens_masks_eos_and_stop_ids_then_releases_them():
    logits = torch.tensor([0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 9.0, 8.0])  # eos (7) first, stop id 8 next
    sampler = Sampler(SamplingParams(min_tokens=2, stop_token_ids=[8]), [EOS])
    assert [sampler.next(logits) for _ in range(3)] == [1, 1, EOS]
    assert sampler.stop_reason(EOS) == "stop"


def test_stop_token_ids_and_eos_finish_with_stop():
    sampler = Sampler(SamplingParams(stop_token_ids=[3, 4]), [EOS])
    assert [sampler.stop_reason(t) for t in (3, 4, EOS, 5)] == ["stop", "stop", "stop", None]


def test_ignore_eos_keeps_going_but_stop_ids_still_stop():
    sampler = Sampler(SamplingParams(ignore_eos=True, stop_token_ids=[3], min_tokens=1), [EOS])
    logits = torch.zeros(10).index_fill(0, torch.tensor([EOS]), 5.0)
    assert sampler.next(logits) == EOS  # eos is not masked by min_tokens either: it does not end the request
    assert sampler.stop_reason(EOS) is None and sampler.stop_reason(3) == "stop"


def test_token_logprobs_are_log_softmax_of_the_raw_logits_and_the_best_alternatives():
    """The chosen token's log-probability under the logits as the model gave them (before penalties
    and temperature), and (rank, token, logprob) for the `top` best in order; the chosen token is
    listed at its own rank when it is not among them (Dynamo's convention), so top 0 gives only it."""
    logits = torch.tensor([1.0, 3.0, 2.0, -1.0])
    lp = torch.log_softmax(logits, 0)
    chosen, top = token_logprobs(logits, 2, 2)
    assert chosen == float(lp[2]) and top == [(1, 1, float(lp[1])), (2, 2, float(lp[2]))]
    assert token_logprobs(logits, 3, 1) == (float(lp[3]), [(1, 1, float(lp[1])), (4, 3, float(lp[3]))])
    bf = torch.log_softmax(logits.to(torch.bfloat16).float(), 0)
    assert token_logprobs(logits.to(torch.bfloat16), 0, 0) == (float(bf[0]), [(3, 0, float(bf[0]))])


def test_stop_ids_past_the_vocabulary_are_harmless():
    sampler = Sampler(SamplingParams(min_tokens=1, stop_token_ids=[10**6]), [EOS])
    assert sampler.next(torch.zeros(10).index_fill(0, torch.tensor([EOS]), 1.0)) != EOS
