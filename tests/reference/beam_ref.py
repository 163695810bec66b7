#!/usr/bin/python3
"""Independent numpy beam search with vLLM 0.5's semantics, on the numpy reference model
(llama_ref.py): the oracle the engine's beams are checked against (issue 32).

Written from vLLM 0.5's definitions (model_executor/layers/sampler.py `_beam_search_sample`,
engine/output_processor/single_step.py `_process_sequence_group_outputs` and
`_check_beam_search_early_stopping`, sequence.py `get_beam_search_score`, outputs.py
`RequestOutput.from_seq_group`), not from pdserve's C code:

  * Logprobs are log_softmax of the logits (float64 here; beam search runs at temperature 0,
    which vLLM treats as 1 for the logprobs).
  * Prompt step: the 2W most likely tokens of the prompt's last position, all children of the
    one sequence. Later steps: over the W running beams, the 2W best (beam cumulative logprob +
    token logprob) pairs, flattened as beam-major (index // V is the parent, % V the token).
  * Each child is stop-checked: EOS (unless ignore_eos) or a stop token id -> "stop", its
    max_tokens output tokens -> "length", max_model_len tokens in all -> "length".
  * Finished children join the finished set, which keeps the W best by beam score; running
    children are ranked by beam score and the W best continue, unless the search stops: no
    running child left, or W finished ones and the early-stopping rule holds:
      True: stop at once;  False: the best running score cannot beat the W-th finished one now;
      "never": with length_penalty > 0 compared at the longest length it could reach
      (max(prompt + max_tokens, max_model_len)), else at its current length.
  * Beam score = cumulative logprob / len ** length_penalty, len = prompt + output tokens, minus
    one when the last token is EOS (for the selection above); the final answer sorts the kept
    sequences by the same score without that EOS correction and returns the n best.

CLI:
  beam_ref.py --model DIR --prompt-ids 1,2,3 --width W [--n N] --max-tokens M
              [--length-penalty 1.0] [--early-stopping false|true|never] [--eos ID]
              [--stop-token-ids 5,6] [--ignore-eos] [--max-model-len L] [--logprobs K]
              [--out FILE.json]
prints (or writes) JSON: {"beams": [{"tokens": [...], "cumulative_logprob": x, "score": s,
"finish_reason": "stop"|"length"}, ...] (the n answered, best first), "precision": "float64"};
with --logprobs K each beam also has "logprobs": per token [logprob, [[id, logprob], ...K]]
(the K most likely tokens of its step, ties: lower id first).
--eos defaults to config.json's eos_token_id (the first, when it is a list).
"""
import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama_ref import Model, emit_json  # noqa: E402


def log_softmax(x):
    m = np.max(x)
    return x - m - np.log(np.sum(np.exp(x - m)))


class Beam:
    def __init__(self, tokens, cum, cache, finish=None, lps=()):
        self.tokens = tokens  # output tokens
        self.lps = list(lps)  # with --logprobs: per token [logprob, [[id, logprob], ...]]
        self.cum = cum  # cumulative logprob
        self.cache = cache  # (k lists, v lists) of the model after its tokens but the last
        self.finish = finish  # None while running, else "stop" / "length"

    def score(self, prompt_len, lp, eos=None, seq_len=None):
        if seq_len is None:
            seq_len = prompt_len + len(self.tokens)
            if eos is not None and self.tokens and self.tokens[-1] == eos:
                seq_len -= 1
        return self.cum / (seq_len ** lp)


def topk_desc(values, k):
    """Indices of the k largest values, largest first (ties: lower index first)."""
    order = np.argsort(-values, kind="stable")
    return [int(i) for i in order[:k]]


def beam_search(m, prompt, width, n, max_tokens, lp=1.0, early="false", eos=None,
                stop_ids=(), ignore_eos=False, max_model_len=None, logprobs=None):
    if max_model_len is None:
        max_model_len = m.cfg.max_pos
    P = len(prompt)
    m.reset()
    logits = m.forward(prompt, 0)[-1]
    root = Beam([], 0.0, (list(m.k_cache), list(m.v_cache)))
    parents = [root]
    parent_lp = [log_softmax(logits)]
    finished = []  # kept finished beams (at most width), best first
    first = True
    while True:
        # candidates: 2W (parent, token) pairs
        if first:
            pairs = [(0, t) for t in topk_desc(parent_lp[0], 2 * width)]
            first = False
        else:
            V = parent_lp[0].shape[0]
            flat = np.concatenate([parents[i].cum + parent_lp[i] for i in range(len(parents))])
            pairs = [(i // V, i % V) for i in topk_desc(flat, 2 * width)]
        children = []
        for pi, t in pairs:
            p = parents[pi]
            c = Beam(p.tokens + [t], p.cum + float(parent_lp[pi][t]), p.cache, lps=p.lps)
            if logprobs is not None:  # the token's logprob and its step's top ones
                top = topk_desc(parent_lp[pi], logprobs)
                c.lps.append([float(parent_lp[pi][t]), [[i, float(parent_lp[pi][i])] for i in top]])
            if (not ignore_eos and eos is not None and t == eos) or t in stop_ids:
                c.finish = "stop"
            elif len(c.tokens) >= max_tokens or P + len(c.tokens) >= max_model_len:
                c.finish = "length"
            children.append(c)
        # finished: the W best of the kept ones and the new ones (stable: kept first)
        new_fin = [c for c in children if c.finish]
        allfin = sorted(finished + new_fin, key=lambda b: b.score(P, lp, eos), reverse=True)
        finished = allfin[:width]
        running = sorted([c for c in children if not c.finish],
                         key=lambda b: b.score(P, lp, eos), reverse=True)
        if not running:
            stop = True
        elif len(allfin) < width:
            stop = False
        else:
            best, worst = running[0], allfin[width - 1]
            stop = early_stopping_holds(early, lp, best, worst, P, max_tokens, max_model_len, eos)
        if stop:
            break
        parents = running[:width]
        parent_lp = []
        for b in parents:  # one step of each continuing beam from its own cache
            m.k_cache, m.v_cache = list(b.cache[0]), list(b.cache[1])
            out = m.forward([b.tokens[-1]], P + len(b.tokens) - 1)[-1]
            b.cache = (list(m.k_cache), list(m.v_cache))
            parent_lp.append(log_softmax(out))
    answer = sorted(finished, key=lambda b: b.score(P, lp), reverse=True)[:n]
    out = [{"tokens": b.tokens, "cumulative_logprob": b.cum, "score": b.score(P, lp),
            "finish_reason": b.finish} for b in answer]
    if logprobs is not None:
        for o, b in zip(out, answer):
            o["logprobs"] = b.lps
    return out


def early_stopping_holds(early, lp, best, worst, P, max_tokens, max_model_len, eos):
    if early == "true":
        return True
    worst_score = worst.score(P, lp, eos)
    if early == "false":
        return worst_score >= best.score(P, lp, eos)
    if lp > 0.0:
        longest = max(P + max_tokens, max_model_len)
        return worst_score >= best.score(P, lp, eos, seq_len=longest)
    return worst_score >= best.score(P, lp, eos)


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-ids", required=True)
    ap.add_argument("--width", type=int, required=True, help="best_of: the beam width")
    ap.add_argument("--n", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, required=True)
    ap.add_argument("--length-penalty", type=float, default=1.0)
    ap.add_argument("--early-stopping", choices=["false", "true", "never"], default="false")
    ap.add_argument("--eos", type=int)
    ap.add_argument("--stop-token-ids", default="")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--max-model-len", type=int)
    ap.add_argument("--logprobs", type=int, help="each token's logprob and K top ones")
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    prompt = [int(s) for s in a.prompt_ids.split(",") if s.strip()]
    stop_ids = {int(s) for s in a.stop_token_ids.split(",") if s.strip()}
    if not prompt:
        ap.error("--prompt-ids: at least one id")
    if not 1 <= a.n <= a.width:
        ap.error("--n: must be in [1, --width]")
    if a.max_tokens < 1:
        ap.error("--max-tokens: must be >= 1")
    m = Model(a.model)
    eos = a.eos
    if eos is None:
        with open(os.path.join(a.model, "config.json")) as f:
            e = json.load(f).get("eos_token_id")
        eos = e[0] if isinstance(e, list) else e
    beams = beam_search(m, prompt, a.width, a.n, a.max_tokens, a.length_penalty,
                        a.early_stopping, eos, stop_ids, a.ignore_eos, a.max_model_len,
                        a.logprobs)
    emit_json({"beams": beams, "precision": "float64"}, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
