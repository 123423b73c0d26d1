"""Logprobs: the target's log-softmax at each emitted (and, asked, each prompt) token, with or without drafts."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from minispec import LLM, SamplingParams

PROMPTS = [[3, 17, 42, 9, 100], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]


@pytest.fixture(scope="module")
def hf_log_softmax(target_dir):
    """log_softmax of transformers' forward over a token sequence ([len(ids), V])."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def run(ids):
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return run


def check(out, lp: torch.Tensor, num_top: int, prompt: bool = False) -> None:
    """out's output (or prompt) logprobs equal lp's rows at each token; top lists sorted, holding the token."""
    ids = out.prompt_token_ids + out.token_ids
    start = 0 if prompt else len(out.prompt_token_ids)
    entries = out.prompt_logprobs if prompt else out.logprobs
    assert len(entries) == (len(out.prompt_token_ids) if prompt else len(out.token_ids))
    for j, entry in enumerate(entries):
        pos = start + j
        if pos == 0:
            assert entry is None  # nothing predicts the first prompt token
            continue
        logprob, top = entry
        assert abs(logprob - lp[pos - 1, ids[pos]].item()) < 1e-4
        assert torch.allclose(torch.tensor([x for _, x in top]), lp[pos - 1].topk(num_top).values, atol=1e-4)
        assert all(abs(x - lp[pos - 1, t].item()) < 1e-4 for t, x in top)  # each id its own (ties may swap ids)
        assert [x for _, x in top] == sorted((x for _, x in top), reverse=True)
        if num_top and logprob >= top[-1][1] + 1e-4:
            assert ids[pos] in [t for t, _ in top]


@pytest.mark.parametrize("draft", [None, "draft"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_logprobs_equal_transformers_with_and_without_drafts(target_dir, draft_dir, hf_log_softmax, draft,
                                                             temperature):
    llm = LLM(target=target_dir, draft=draft_dir if draft else None, num_speculative_tokens=3, seed=0)
    params = SamplingParams(temperature=temperature, top_k=20, max_tokens=12, ignore_eos=True, logprobs=5,
                            prompt_logprobs=3, seed=4)
    for out in llm.generate(PROMPTS, params):
        lp = hf_log_softmax(out.prompt_token_ids + out.token_ids)
        check(out, lp, 5)
        check(out, lp, 3, prompt=True)
    if draft:  # the drafts were verified, so the logprobs were read at accepted drafts' positions too
        assert out.metrics["num_draft_tokens"] > 0


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
