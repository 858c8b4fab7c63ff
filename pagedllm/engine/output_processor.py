"""Output processing: the step's new token ids in, RequestOutputs out (vLLM v1's idea).

One object owns everything text: incremental detokenizing, stop strings, the texts of
logprob entries, and the outputs each request's `output_kind` asks for. A DELTA output
holds only what is new since the last (the new ids, and the new text that can no longer
become part of a stop string or of a character still missing bytes), so a stream writes
what it is given and nothing is copied whole per step. The scheduler owns the tokens;
this owns their text. It reads the step's update and changes nothing of the engine: where a
stop string ends a sequence (or its text cannot be made) comes back as data, which the
engine applies (step_update.StepApplier.decide) before it asks for the outputs.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..outputs import CompletionOutput, Logprob, RequestOutput
from ..sampling_params import RequestOutputKind
from .detokenizer import INCOMPLETE, DetokState, detokenize, final_text, token_text
from .sequence import Request, Sequence
from .step_types import StepUpdate
from .step_update import Failed, StopAt

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _SeqText:
    """A sequence's text and what of it, and of its ids and logprobs, went out already."""
    text: str = ""
    detok: DetokState = field(default_factory=DetokState)
    sent_text: int = 0
    sent_tokens: int = 0
    sent_logprobs: int = 0
    decoded_logprobs: int = 0
    done_sent: bool = False


@dataclass(slots=True)
class _ReqState:
    seqs: dict[int, _SeqText] = field(default_factory=dict)
    # The request's prompt logprobs in vLLM's shape, built from its scores as they come
    # (entry 0 is None: nothing predicts the first token), and how many went out.
    prompt_logprobs: list = field(default_factory=lambda: [None])
    sent_prompt_logprobs: int = 0


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._reqs: dict[str, _ReqState] = {}
        self._texts: dict[int, str] = {}

    # -- per step --------------------------------------------------------------
    def stops(self, up: StepUpdate) -> list[StopAt | Failed]:
        """Where the step's new tokens complete a stop string, and the requests whose text
        could not be made (e.g. a tokenizer that cannot decode: that request only)."""
        runs: dict[Sequence, int] = {}  # tokens each sequence with stop strings got this step
        for seq, _ in up.new_tokens:
            if seq.params.stop:
                runs[seq] = runs.get(seq, 0) + 1
        found: list[StopAt | Failed] = []
        for seq, n in runs.items():
            if seq.request.error is None:
                try:
                    stop = self._check_stop_strings(seq, n)
                except Exception as e:
                    found.append(Failed(seq.request, f"{type(e).__name__}: {e}"))
                else:
                    if stop is not None:
                        found.append(stop)
        return found

    def outputs(self, up: StepUpdate, stream: bool, now: float) -> list[RequestOutput]:
        """The outputs due after a step: every moved request's (as its output_kind says) when
        streaming, else the finished ones'."""
        outputs = []
        for req in up.touched.values():
            if req.finished:
                req.finish_time = now
            out = self.output(req, stream)
            if out is not None:
                outputs.append(out)
        return outputs

    def output(self, req: Request, stream: bool = True) -> RequestOutput | None:
        """The request's output now, or None if none is due; a finished request's last."""
        if not req.finished and (not stream or req.params.output_kind is RequestOutputKind.FINAL_ONLY):
            return None
        try:
            return self._beam_output(req) if req.beam is not None else self._output(req)
        finally:
            if req.finished:
                self._reqs.pop(req.request_id, None)

    # -- stop strings ----------------------------------------------------------
    def _check_stop_strings(self, seq: Sequence, n: int) -> StopAt | None:
        """Look for a stop string in the text each of the step's n new tokens adds, in order
        (a verified run of drafts may hold one mid-way). Not before min_tokens, and not at
        a token that stopped the sequence itself (EOS, a stop token id): those come first.
        The text is cut at it here; the tokens after it go when the StopAt is applied."""
        p = seq.params
        if seq.finish_reason not in (None, "length"):
            if seq.finish_reason != "stop" or isinstance(seq.stop_reason, str):
                return None
        st = self._seq(seq)
        last = seq.num_output_tokens - (seq.finish_reason == "stop")
        longest = max(len(s) for s in p.stop)
        for count in range(max(seq.num_output_tokens - n + 1, p.min_tokens, 1), last + 1):
            # Only the new text, and the tail it may complete a stop string with, can hold
            # a stop string that was not there one token ago.
            tail = max(0, len(st.text) - longest + 1)
            new = detokenize(self.tokenizer, seq.token_ids, seq.num_prompt_tokens, st.detok,
                             p.skip_special_tokens, end=seq.num_prompt_tokens + count)
            if not new:
                continue
            st.text += new
            for s in p.stop:
                at = st.text.find(s, tail)
                if at >= 0:
                    st.text = st.text[:at + len(s)] if p.include_stop_str_in_output else st.text[:at]
                    return StopAt(seq, count, s)
        return None

    # -- outputs ---------------------------------------------------------------
    def _state(self, req: Request) -> _ReqState:
        st = self._reqs.get(req.request_id)
        if st is None:
            st = self._reqs[req.request_id] = _ReqState()
        return st

    def _seq(self, seq: Sequence) -> _SeqText:
        seqs = self._state(seq.request).seqs
        st = seqs.get(seq.seq_id)
        if st is None:
            st = seqs[seq.seq_id] = _SeqText()
        return st

    def _catch_up(self, seq: Sequence, st: _SeqText) -> None:
        """Bring the text up to the output ids, decoding only the new ones. A character
        still missing bytes is held back until the sequence ends."""
        if seq.finish_reason == "stop" and isinstance(seq.stop_reason, str):
            return  # cut at its stop string already
        args = (self.tokenizer, seq.token_ids, seq.num_prompt_tokens, st.detok, seq.params.skip_special_tokens)
        if seq.finished:
            st.text = final_text(*args, st.text)
        else:
            st.text += detokenize(*args)

    def _output(self, req: Request) -> RequestOutput | None:
        p = req.params
        delta = p.output_kind is RequestOutputKind.DELTA
        seqs = req.seqs
        if p.ranks_samples:
            # best_of: the n samples of highest cumulative logprob, known only at the end
            # (vLLM streams none of a best_of request either).
            seqs = sorted(seqs, key=lambda s: -s.cumulative_logprob)[:p.n] if req.finished else []
        outs = []
        for index, seq in enumerate(seqs):
            st = self._seq(seq)
            self._catch_up(seq, st)
            if p.logprobs is not None:
                for entry in seq.logprobs[st.decoded_logprobs:]:
                    self._decode(entry)
                st.decoded_logprobs = len(seq.logprobs)
            cumulative = seq.cumulative_logprob if p.logprobs is not None or p.ranks_samples else None
            if not delta:
                outs.append(CompletionOutput(index, st.text, seq.output_token_ids, seq.finish_reason,
                                             seq.stop_reason, list(seq.logprobs) if p.logprobs is not None else None,
                                             cumulative))
                continue
            c = self._delta(index, seq, st, cumulative)
            if c is not None:
                outs.append(c)
        if delta and not outs and not req.finished:
            return None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                             req.num_cached_tokens, self._metrics(req, [s.num_output_tokens for s in seqs]),
                             req.error, self._prompt_logprobs(req, delta),
                             req.embedding.tolist() if req.embedding is not None and req.finished else None,
                             req.error_invalid)

    def _delta(self, index: int, seq: Sequence, st: _SeqText, cumulative: float | None) -> CompletionOutput | None:
        """What is new of one sequence since its last output; None if nothing is."""
        end = len(st.text) if seq.finished else self._safe_len(st.text, seq.params.stop)
        text = st.text[st.sent_text:end]
        st.sent_text = max(st.sent_text, end)
        ids = seq.token_ids[seq.num_prompt_tokens + st.sent_tokens:]
        st.sent_tokens = seq.num_output_tokens
        lps = None
        if seq.params.logprobs is not None:
            lps, st.sent_logprobs = seq.logprobs[st.sent_logprobs:], len(seq.logprobs)
        finishing = seq.finished and not st.done_sent
        if not (text or ids or lps or finishing):
            return None
        st.done_sent = seq.finished
        return CompletionOutput(index, text, ids, seq.finish_reason, seq.stop_reason, lps, cumulative)

    @staticmethod
    def _safe_len(text: str, stops: list[str]) -> int:
        """How much of a running sequence's text can go out: not a tail that may still
        become a stop string, nor a character still missing bytes."""
        end = len(text)
        while end and text[end - 1] == INCOMPLETE:
            end -= 1
        if stops:
            end = max(0, min(end, len(text) - max(len(s) for s in stops) + 1))
        return end

    def _prompt_logprobs(self, req: Request, delta: bool) -> list | None:
        scores = req.prompt_scores
        if scores is None:
            return None
        st = self._state(req)
        got, k, ids = st.prompt_logprobs, req.params.prompt_logprobs, req.prompt_token_ids
        for i in range(len(got) - 1, len(scores)):   # scores[i] is token i + 1's
            got.append(self._decode(scores.entry(i, ids[i + 1], k)))
        if not delta:
            return list(got)
        new, st.sent_prompt_logprobs = got[st.sent_prompt_logprobs:], len(got)
        return new or None

    def _decode(self, entry: dict[int, Logprob]) -> dict[int, Logprob]:
        """Set each token's text alone (vLLM's decoded_token)."""
        for tid, lp in entry.items():
            lp.decoded_token = self._token_text(tid)
        return entry

    def _token_text(self, tid: int) -> str:
        """A token's text alone, remembered (at most one string per vocabulary entry): a
        prompt's logprobs decode its tokens and their top k, thousands per request."""
        text = self._texts.get(tid)
        if text is None:
            text = self._texts[tid] = token_text(self.tokenizer, tid)
        return text

    def _beam_output(self, req: Request) -> RequestOutput:
        """The kept hypotheses, best score first, once the search is over (nothing before:
        a beam's tokens can still be dropped)."""
        outs = []
        if req.finished and req.error is None:
            for i, h in enumerate(req.beam.results()):
                text = self.tokenizer.decode(h.output_ids, skip_special_tokens=True)
                outs.append(CompletionOutput(i, text, list(h.output_ids), h.finish_reason,
                                             h.output_ids[-1] if h.finish_reason == "stop" else None,
                                             None, h.cumulative))
        metrics = self._metrics(req, [len(c.token_ids) for c in outs])
        metrics.update(n=req.beam.width, beam_scores=[h.score for h in req.beam.results()])
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, outs, req.finished,
                             req.num_cached_tokens, metrics, req.error, error_invalid=req.error_invalid)

    @staticmethod
    def _metrics(req: Request, output_lens: list[int]) -> dict:
        """The request's times and sizes. output_lens: each completion's tokens so far
        (a DELTA output's own token_ids hold only the new ones)."""
        return {"arrival_time": req.arrival_time, "scheduled_time": req.scheduled_time,
                "first_token_time": req.first_token_time, "finish_time": req.finish_time,
                "n": req.params.n, "max_tokens": req.max_tokens, "output_lens": output_lens}
