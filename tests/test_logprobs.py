"""Logprobs: the target's log-softmax at each emitted (and, asked, each prompt) token, with or without drafts."""
import pytest
import torch
from minispec import LLM, SamplingParams
from tests import utils

PROMPTS = [[3, 17, 42, 9, 100], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def hf_log_softmax(target_dir):
    return utils.hf_log_softmax(target_dir)


def check(out, lp: torch.Tensor, num_top: int, prompt: bool = False) -> None:
    """out's output (or prompt) logprobs equal lp's (tests/utils.check_logprobs); the first prompt token's is None."""
    ids = out.prompt_token_ids + out.token_ids
    if prompt:
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
        utils.check_logprobs(lp, ids, 1, out.prompt_logprobs[1:], num_top)
    else:
        assert len(out.logprobs) == len(out.token_ids)
        utils.check_logprobs(lp, ids, len(out.prompt_token_ids), out.logprobs, num_top)


@pytest.mark.parametrize("draft", [None, "draft", "target"])  # the target drafting for itself: drafts accepted
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_equal_transformers_with_and_without_drafts(target_dir, draft_dir, hf_log_softmax, draft,
                                                             temperature):
    llm = LLM(target=target_dir, draft={None: None, "draft": draft_dir, "target": target_dir}[draft],
              num_speculative_tokens=3, seed=0)
    params = SamplingParams(temperature=temperature, top_k=20, max_tokens=12, ignore_eos=True, logprobs=5,
                            prompt_logprobs=3, seed=4)
    for out in llm.generate(PROMPTS, params):
        lp = hf_log_softmax(out.prompt_token_ids + out.token_ids)
        check(out, lp, 5)
        check(out, lp, 3, prompt=True)
    if draft == "target":  # logprobs read at accepted drafts' positions too
        assert out.metrics["num_accepted_tokens"] > 0


def test_chunked_prompt_and_max_tokens_0_score_the_prompt(target_dir, hf_log_softmax):
    """A prompt prefilled in chunks of 4 is scored chunk by chunk; max_tokens 0 generates nothing."""
    llm = LLM(target=target_dir, draft=None, max_num_batched_tokens=4)
    out = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert out.token_ids == [] and out.finish_reason == "length" and out.logprobs is None
    check(out, hf_log_softmax(PROMPTS[1]), 2, prompt=True)


def test_without_logprobs_nothing_is_kept(target_dir):
    out = LLM(target=target_dir, draft=None).generate([PROMPTS[0]], SamplingParams(max_tokens=3))[0]
    assert out.logprobs is None and out.prompt_logprobs is None and "logprobs" not in out.as_dict()
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1, got 0"):
        SamplingParams(max_tokens=0, logprobs=2)
    with pytest.raises(ValueError, match="logprobs must be an integer >= 0"):
        SamplingParams(logprobs=-1)


def test_logprobs_need_tp_1(target_dir, monkeypatch):
    """Under TP each rank holds a slice of the vocabulary's logits: a request that asks is refused at once."""
    from types import SimpleNamespace

    from minispec.serve.protocol import APIError, parse_job

    llm = LLM(target=target_dir, draft=None)
    monkeypatch.setattr(llm.engine, "tp", SimpleNamespace(world_size=2))
    for params in (SamplingParams(logprobs=0), SamplingParams(prompt_logprobs=1)):
        with pytest.raises(ValueError, match="need tensor_parallel_size 1"):
            llm.add_request([1, 2, 3], params)
    with pytest.raises(APIError, match="logprobs need a server with --tp 1") as e:
        parse_job({"prompt": [1, 2, 3], "logprobs": 1}, False, llm, "tiny")
    assert e.value.status == 400 and e.value.param == "logprobs"
