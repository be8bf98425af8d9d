"""`LLM`: the synchronous offline API (batch of prompts in, completions out)."""

import itertools
from collections.abc import Sequence
from typing import Literal

from ddtree_serve.config import EngineConfig
from ddtree_serve.engine.local import build_local_engine
from ddtree_serve.engine.outputs import CompletionOutput, Detokenizer
from ddtree_serve.engine.sampling_params import SamplingParams
from ddtree_serve.engine.spec_engine import SpecEngine

Prompt = str | Sequence[int]


class LLM:
    """Speculative decoding in this process: the bundled pair by default, or local model dirs.

    >>> llm = LLM(mode="ddtree", budget=32)
    >>> llm.generate("def fibonacci(n):", SamplingParams(max_tokens=64))[0].text
    """

    def __init__(
        self,
        target: str | None = None,
        drafter: str | None = None,
        *,
        mode: Literal["ar", "chain", "ddtree"] = "ddtree",
        budget: int = 32,
        device: str = "cpu",
        dtype: Literal["float32", "bfloat16", "float16"] = "float32",
        max_num_seqs: int = 8,
        max_seq_len: int | None = None,
        enforce_eager: bool = False,
    ) -> None:
        """`max_seq_len`: None = `EngineConfig`'s default, capped at the target's context length
        (a number is taken as asked, and refused past that length). `enforce_eager`: no CUDA
        graphs (see `EngineConfig`)."""
        lengths = {} if max_seq_len is None else {"max_seq_len": max_seq_len}
        config = EngineConfig(
            target=target,
            drafter=drafter,
            mode=mode,
            budget=budget,
            device=device,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
            **lengths,
        )
        self._init_from(config, build_local_engine(config))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._init_from(config, build_local_engine(config))
        return llm

    @classmethod
    def from_engine(cls, engine: SpecEngine, config: EngineConfig | None = None) -> "LLM":
        """Wrap an engine built elsewhere (tests, custom Drafter/Target implementations)."""
        llm = cls.__new__(cls)
        llm._init_from(config or EngineConfig(mode=engine.settings.mode), engine)
        return llm

    def _init_from(self, config: EngineConfig, engine: SpecEngine) -> None:
        self.config = config
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._request_ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[CompletionOutput]:
        """Generate for every prompt (batched by the engine); outputs in prompt order.

        `prompts`: one prompt or a list; a prompt is text or a list of token ids.
        `params`: one for all, one per prompt, or None for the config's defaults.
        """
        prompt_list = _as_prompt_list(prompts)
        if params is None:
            params = self.config.default_sampling_params()
        param_list = [params] * len(prompt_list) if isinstance(params, SamplingParams) else list(params)
        if len(param_list) != len(prompt_list):
            raise ValueError(f"{len(param_list)} SamplingParams for {len(prompt_list)} prompts")

        order: dict[str, int] = {}
        detokenizers: dict[str, Detokenizer] = {}
        try:
            for prompt, request_params in zip(prompt_list, param_list, strict=True):
                request_id = f"llm-{next(self._request_ids)}"
                self.engine.add_request(request_id, prompt, request_params)
                order[request_id] = len(order)
                detokenizers[request_id] = Detokenizer(self.tokenizer, request_params.stop)
        except BaseException:
            # One refused prompt refuses the call: take back the ones already queued.
            for request_id in order:
                self.engine.abort_request(request_id)
            raise
        results: list[CompletionOutput | None] = [None] * len(prompt_list)
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.finished and output.request_id in order:
                    results[order[output.request_id]] = detokenizers[output.request_id].update(output)
        assert all(r is not None for r in results), "every request finishes before the loop ends"
        return [r for r in results if r is not None]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (text, or a flat list of ids) or a list of prompts -> list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    prompt_list = list(prompts)
    if prompt_list and all(isinstance(t, int) for t in prompt_list):
        return [prompt_list]  # type: ignore[list-item]
    return prompt_list  # type: ignore[return-value]
