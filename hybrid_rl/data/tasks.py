"""Tasks: how one raw data row becomes a chat prompt and a ground truth.

A task knows the fields of its rows (``question``/``answer`` for GSM8K,
``digit`` for the synthetic successor task), the user message it shows the
model, the ground-truth string the reward function compares against, and the
reward function that fits it by default, and for multi-turn rollouts what an
environment may read of the row beside the prompt (``env_info``: the ``lookup``
task's hidden character). Synthetic tasks also generate their own rows, so a CPU smoke
run needs no data file at all. This module also defines ``DataError`` because it is
the lowest layer of ``hybrid_rl.data``; the other modules import it from here.

The ``gsm8k``, ``math``, ``code`` and ``chat`` tasks also read rows as verl's data preparation writes them (``prompt``: the
messages, ``reward_model.ground_truth``, ``data_source``, ``extra_info``), as they are: the prompt is not changed,
each row keeps its own ``data_source`` (validation reports each), and its ``extra_info`` goes to a reward function
that takes it (and to a multi-turn environment). Left out: images.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from . import mul3
from .answers import extract_answer, extract_integer, last_boxed
from .arith import ArithConfig, held_out_rows, training_rows


class DataError(ValueError):
    """Bad data or data config; the one-line message names the key or file and the fix."""


# verl's GSM8K instruction, so scores are comparable with verl's examples.
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


class Task:
    """Base class: a named row format with a default reward function."""

    name: str = ""
    default_reward: str = ""
    synthetic: bool = False
    reads_verl_rows: bool = False
    """Whether a row in verl's layout (``is_verl_row``) is taken as it is (``verl_row``)."""

    def format(self, row: dict[str, Any], row_id: int) -> dict[str, Any]:
        """``format_row``'s result for a row of this task's own layout, or ``verl_row``'s for a verl row."""
        if self.reads_verl_rows and is_verl_row(row):
            return verl_row(row, row_id, self.name)
        return self.format_row(row, row_id)

    def format_row(self, row: dict[str, Any], row_id: int) -> dict[str, Any]:
        """``{"messages": [...], "ground_truth": str, "data_source": name}`` for one row, optionally with
        ``"env_info": {...}`` (JSON-able) for the environment of a multi-turn rollout; ``row_id`` is the row's number
        in messages (``PromptDataset`` counts from 1 and adds the key and file)."""
        raise NotImplementedError

    def answer_stats(self, responses: list[str]) -> dict[str, float]:
        """Per-batch counts that say how responses are shaped, apart from their score (logged as
        ``reward/<name>`` and ``val/<name>``, fractions of the responses); none by default. The keys must not depend
        on the responses (an empty list included): every rank all-reduces the same ones."""
        return {}

    votes: bool = False
    """Whether ``vote_key`` reads final answers (validation's majority vote, ``val/reward_maj_of_n``)."""

    def vote_key(self, response: str) -> str | None:
        """The response's final answer as the majority vote compares it (a normalised text), or None when it has
        none; only for tasks that ``votes``."""
        return None

    def generate(self, num: int, seed: int, options: Any = None) -> list[dict[str, Any]]:
        """Deterministic synthetic rows; only synthetic tasks have them. ``options``: the task's own config section
        (``data.<task>``), for the tasks that have one."""
        raise DataError(f"data.train_path: task {self.name!r} is not synthetic, so 'synthetic:{self.name}' has no rows; "
                        f"point data.train_path at a .jsonl/.parquet file or a datasets hub name")

    def held_out(self, options: Any = None) -> list[dict[str, Any]] | None:
        """The synthetic task's fixed test set, disjoint from every row ``generate`` can return, or None when the task
        has none (validation then draws ``generate`` rows with another seed)."""
        return None

    def _field(self, row: dict[str, Any], key: str, row_id: int) -> Any:
        if not isinstance(row, dict):
            raise DataError(f"row {row_id}: expected a mapping of fields, got {type(row).__name__}; fix the data file")
        if key not in row:
            raise DataError(f"row {row_id} has no {key!r} field, which the {self.name} task needs (its fields: "
                            f"{sorted(row)}); fix the data or set data.task to the task that matches it")
        if row[key] is None:
            raise DataError(f"row {row_id}: its {key!r} field, which the {self.name} task needs, is null; fix the data")
        return row[key]


class Gsm8kTask(Task):
    """Grade-school math: ``question`` → prompt, the text after ``####`` in ``answer`` → ground truth."""

    name = "gsm8k"
    default_reward = "gsm8k"
    reads_verl_rows = True
    votes = True

    def vote_key(self, response: str) -> str | None:
        answer = extract_answer(response, "flexible")
        if answer is None:
            return None
        try:
            return repr(float(answer))  # 18, 18.0 and 18.00 are one answer
        except ValueError:
            return answer

    def answer_stats(self, responses: list[str]) -> dict[str, float]:
        """``format_strict``: responses with the ``#### <number>`` line the prompt asks for; ``answer_found``: responses
        the flexible reward can read any answer from (so a wrong answer is told apart from no answer at all)."""
        return {"format_strict": float(sum(extract_answer(r, "strict") is not None for r in responses)),
                "answer_found": float(sum(extract_answer(r, "flexible") is not None for r in responses))}

    def format_row(self, row: dict[str, Any], row_id: int) -> dict[str, Any]:
        question = self._field(row, "question", row_id)
        answer = self._field(row, "answer", row_id)
        if not isinstance(question, str):
            raise DataError(f"row {row_id}: gsm8k 'question' must be text, got {type(question).__name__}; fix the data")
        text = str(answer)
        if "####" in text:
            truth = text.split("####")[-1]
        else:
            # Some copies of GSM8K keep only the final number; accept it when it
            # is one, rather than silently training on a whole solution string.
            truth = text
            if not _is_number(truth.replace(",", "").strip()):
                raise DataError(f"row {row_id}: gsm8k 'answer' has no '####' marker and is not a bare number "
                                f"({_short(text)!r}); use GSM8K's answer format ('... #### 42')")
        truth = truth.replace(",", "").strip()
        if not truth:
            raise DataError(f"row {row_id}: gsm8k 'answer' has nothing after '####'; fix the data")
        return {
            "messages": [{"role": "user", "content": question + "\n" + GSM8K_INSTRUCTION}],
            "ground_truth": truth,
            "data_source": _source(row, self.name),
        }


class SuccessorTask(Task):
    """Show one digit d, expect ``(d + 1) % 10``.

    Chosen because a tiny randomly initialised model can learn it from reward
    alone in a few dozen CPU steps: ten prompts, ten one-character answers, and
    a random policy already hits the right digit often enough for GRPO to have
    signal. The prompt is just the digit, since a tiny model attends badly over
    long contexts.
    """

    name = "successor"
    default_reward = "successor"
    synthetic = True
    votes = True

    def vote_key(self, response: str) -> str | None:
        return response.strip() or None

    def format_row(self, row: dict[str, Any], row_id: int) -> dict[str, Any]:
        raw = self._field(row, "digit", row_id)
        try:
            digit = int(raw)
        except (TypeError, ValueError):
            digit = -1
        if isinstance(raw, bool) or not 0 <= digit <= 9 or (isinstance(raw, float) and raw != digit):
            raise DataError(f"row {row_id}: successor 'digit' must be an integer 0-9, got {raw!r}; fix the data")
        return {
            "messages": [{"role": "user", "content": str(digit)}],
            "ground_truth": str((digit + 1) % 10),
            "data_source": self.name,
        }

    def generate(self, num: int, seed: int, options: Any = None) -> list[dict[str, Any]]:
        if num <= 0:
            raise DataError(f"data.num_synthetic={num} must be a positive number of rows")
        rng = np.random.default_rng(seed)
        return [{"digit": int(d)} for d in rng.integers(0, 10, size=num)]


# the arithmetic task's instruction: SmolLM2-135M-Instruct answers "What is 37 + 45?" with a paragraph without it
ARITH_INSTRUCTION = "Answer with just the number."


class ArithTask(Task):
    """Arithmetic with a held-out test set (``hybrid_rl.data.arith``): rows ``family``/``question``/``answer`` → the
    question and the instruction to answer with just the number; the reward is the exact integer
    (``hybrid_rl.rewards.arith``). ``data_source`` is ``arith_<family>``, so validation reports every family's
    accuracy (``val/reward_mean/arith_add``, ...)."""

    name = "arith"
    default_reward = "arith"
    synthetic = True
    votes = True

    def vote_key(self, response: str) -> str | None:
        answer = extract_integer(response)
        return None if answer is None else str(answer)

    def answer_stats(self, responses: list[str]) -> dict[str, float]:
        """``format_exact``: responses that are the number and nothing else (what the prompt asks for);
        ``answer_found``: responses with any number in them."""
        return {"format_exact": float(sum(extract_integer(r, "strict") is not None for r in responses)),
                "answer_found": float(sum(extract_integer(r) is not None for r in responses))}

    def format_row(self, row: dict[str, Any], row_id: int) -> dict[str, Any]:
        question = self._field(row, "question", row_id)
        answer = self._field(row, "answer", row_id)
        family = row.get("family") or "mixed"
        try:
            truth = int(str(answer).strip())
        except ValueError:
            raise DataError(f"row {row_id}: arith 'answer' must be an integer, got {_short(str(answer))!r}; "
                            f"fix the data") from None
        return {"messages": [{"role": "user", "content": f"{question} {ARITH_INSTRUCTION}"}],
                "ground_truth": str(truth), "data_source": f"arith_{family}"}

    def generate(self, num: int, seed: int, options: Any = None) -> list[dict[str, Any]]:
        if num <= 0:
            raise DataError(f"data.num_synthetic={num} must be a positive number of rows")
        try:
            return training_rows(num, seed, options or ArithConfig())
        except ValueError as e:
            raise DataError(str(e)) from None

    def held_out(self, options: Any = None) -> list[dict[str, Any]]:
        try:
            return held_out_rows(options or ArithConfig())
        except ValueError as e:
            raise DataError(str(e)) from None


class LookupTask(Task):
    """A digit the prompt does not show: only the ``lookup`` tool reveals it, and the answer is that digit.

    Every prompt is the same ``?``; the row's digit is its ground truth and what it keeps for the environment
    (``env_info["value"]``). The ``lookup`` environment (``envs/builtin.LookupEnv``) scores it: 1 for the digit,
    but only after its tool revealed it, so a guess earns nothing (the reward function is ``none``). Made for the
    tiny random-init model (``recipes/cpu_lookup_tool.yaml``): the call is one token of
    ``builtin:tiny-qwen2-lookup``, whose template writes the result inline, right before the answer."""

    name = "lookup"
    default_reward = "none"
    synthetic = True
    PROMPT = "?"

    def format_row(self, row: dict[str, Any], row_id: int) -> dict[str, Any]:
        raw = self._field(row, "value", row_id)
        if isinstance(raw, bool) or not isinstance(raw, int) or not 0 <= raw <= 9:
            raise DataError(f"row {row_id}: lookup 'value' must be an integer 0-9, got {raw!r}; fix the data")
        return {"messages": [{"role": "user", "content": self.PROMPT}], "ground_truth": str(raw),
                "data_source": self.name, "env_info": {"value": raw}}

    def generate(self, num: int, seed: int, options: Any = None) -> list[dict[str, Any]]:
        if num <= 0:
            raise DataError(f"data.num_synthetic={num} must be a positive number of rows")
        rng = np.random.default_rng(seed)
        return [{"value": int(d)} for d in rng.integers(0, 10, size=num)]


class Mul3Task(Task):
    """Three-digit by three-digit products (``hybrid_rl.data.mul3``), a held-out test set by unordered pair of
    factors; the question, then the instruction to answer with just the number; the exact-integer reward."""

    name = "mul3"
    default_reward = "arith"
    synthetic = True

    answer_stats = ArithTask.answer_stats
    votes = True
    vote_key = ArithTask.vote_key

    def format_row(self, row: dict[str, Any], row_id: int) -> dict[str, Any]:
        question = self._field(row, "question", row_id)
        answer = self._field(row, "answer", row_id)
        try:
            truth = int(str(answer).strip())
        except ValueError:
            raise DataError(f"row {row_id}: mul3 'answer' must be an integer, got {_short(str(answer))!r}; "
                            f"fix the data") from None
        return {"messages": [{"role": "user", "content": f"{question} {ARITH_INSTRUCTION}"}],
                "ground_truth": str(truth), "data_source": self.name}

    def generate(self, num: int, seed: int, options: Any = None) -> list[dict[str, Any]]:
        try:
            return mul3.training_rows(num, seed)
        except ValueError as e:
            raise DataError(str(e)) from None

    def held_out(self, options: Any = None) -> list[dict[str, Any]]:
        return mul3.held_out_rows()


# verl's MATH instruction, so scores are comparable with verl's examples.
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


class MathTask(Task):
    """Competition math with LaTeX answers (MATH, MATH-500, AIME, DAPO-Math): ``problem`` (or ``question``) → the
    problem and verl's instruction to put the final answer in ``\\boxed{}``; ground truth: ``answer``, or the last
    ``\\boxed{}`` of ``solution`` (Hendrycks MATH). A row's ``data_source`` field, where it has one, names its
    source (validation reports each). The reward (``rewards/math.py``) compares answers mathematically."""

    name = "math"
    default_reward = "math"
    reads_verl_rows = True
    votes = True

    def vote_key(self, response: str) -> str | None:
        """The last ``\\boxed{}`` under the math reward's light normalisation (``\\frac12`` and ``0.5`` stay two
        answers: the vote compares texts)."""
        from ..rewards.math import normalize

        answer = last_boxed(response)
        return None if answer is None else normalize(answer)

    def answer_stats(self, responses: list[str]) -> dict[str, float]:
        """``boxed_found``: responses with a closed ``\\boxed{}`` (the form the prompt asks for)."""
        return {"boxed_found": float(sum(last_boxed(r) is not None for r in responses))}

    def format_row(self, row: dict[str, Any], row_id: int) -> dict[str, Any]:
        problem = self._field(row, "problem" if "problem" in row or "question" not in row else "question", row_id)
        if not isinstance(problem, str) or not problem.strip():
            raise DataError(f"row {row_id}: math 'problem' must be a non-empty text, got {_short(repr(problem))!r}; "
                            f"fix the data")
        if row.get("answer") is not None:
            truth = str(row["answer"]).strip()
            if "\n####" in truth:
                raise DataError(f"row {row_id}: math 'answer' is a GSM8K solution ending in '#### <number>' "
                                f"({_short(truth)!r}); set data.task=gsm8k for GSM8K's rows")
        else:
            solution = self._field(row, "solution" if "solution" in row else "answer", row_id)
            truth = last_boxed(str(solution))
            if truth is None:
                raise DataError(f"row {row_id}: math 'solution' has no \\boxed{{}} answer ({_short(str(solution))!r}) "
                                f"and the row has no 'answer'; add the final answer as 'answer'")
        if not truth:
            raise DataError(f"row {row_id}: math 'answer' is empty; fix the data")
        return {"messages": [{"role": "user", "content": f"{problem} {MATH_INSTRUCTION}"}], "ground_truth": truth,
                "data_source": _source(row, self.name), **_extra(row, row_id)}


CODE_INSTRUCTION = "Write the solution in Python, in one ```python code block."


class CodeTask(Task):
    """Programming problems checked by running tests (``rewards/code.py``): the problem text (``prompt``,
    ``question``, ``problem`` or MBPP's ``text``) and its tests, either Python assertions (MBPP's ``test_list``, or
    ``tests`` as a list of texts; the first is shown in the prompt, which names the function to write) or
    standard input/output cases (APPS' and TACO's ``input_output``, ``{"inputs": [...], "outputs": [...]}`` or its
    JSON text, or ``tests`` as a list of ``{"input", "output"}``). The ground truth is the tests as JSON."""

    name = "code"
    default_reward = "code"
    reads_verl_rows = True

    def answer_stats(self, responses: list[str]) -> dict[str, float]:
        """``code_found``: responses with a fenced code block (what the prompt asks for)."""
        from ..rewards.code import extract_code

        return {"code_found": float(sum(extract_code(r) is not None for r in responses))}

    def format_row(self, row: dict[str, Any], row_id: int) -> dict[str, Any]:
        if not isinstance(row, dict):
            raise DataError(f"row {row_id}: expected a mapping of fields, got {type(row).__name__}; fix the data file")
        key = next((k for k in ("prompt", "question", "problem", "text") if isinstance(row.get(k), str)), None)
        if key is None:
            raise DataError(f"row {row_id} has no problem text ('prompt', 'question', 'problem' or 'text'; its fields: "
                            f"{sorted(row)}); fix the data or set data.task to the task that matches it")
        tests, shown = _code_tests(row, row_id)
        text = row[key].strip()
        if shown:
            text += f"\n\nYour code should pass this test:\n{shown}"
        else:
            text += "\n\nRead the input from standard input and write the answer to standard output."
        return {"messages": [{"role": "user", "content": f"{text}\n\n{CODE_INSTRUCTION}"}],
                "ground_truth": json.dumps(tests), "data_source": _source(row, self.name), **_extra(row, row_id)}


def _code_tests(row: dict[str, Any], row_id: int) -> tuple[dict[str, Any], str | None]:
    """A code row's tests as the ``code`` reward reads them, and the assertion to show in the prompt (None for
    input/output cases)."""
    from ..rewards.code import normalize_tests

    raw = row.get("test_list", row.get("tests", row.get("input_output")))
    tests = normalize_tests(raw)
    if tests is None:
        raise DataError(f"row {row_id}: no tests the code task can run: 'test_list' or 'tests' (Python assertions, or "
                        f"{{'input', 'output'}} cases) or 'input_output' ({{'inputs': [...], 'outputs': [...]}}, one "
                        f"output per input), got {_short(repr(raw))!r}; fix the data")
    setup = row.get("test_setup_code")
    if "asserts" in tests and isinstance(setup, str) and setup.strip():  # MBPP: imports the tests need
        tests = {"asserts": [f"{setup}\n{a}" for a in tests["asserts"]]}
        return tests, tests["asserts"][0].split("\n")[-1]
    return tests, tests["asserts"][0] if "asserts" in tests else None


class ChatTask(Task):
    """Prompts alone, for a reward model (``reward.model.path``) or a reward function that needs no answer: a row's
    ``messages`` (a list of ``{"role", "content"}``, the conversation so far) or ``prompt`` (a text, one user turn; or
    such a list, TRL's conversational format); its ``ground_truth`` where it has one (else empty). The reward
    function by default is ``none``: the reward model's score is the reward."""

    name = "chat"
    default_reward = "none"
    reads_verl_rows = True

    def format_row(self, row: dict[str, Any], row_id: int) -> dict[str, Any]:
        if not isinstance(row, dict):
            raise DataError(f"row {row_id}: expected a mapping of fields, got {type(row).__name__}; fix the data file")
        key = "messages" if "messages" in row else "prompt"
        raw = self._field(row, key, row_id)
        messages = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
        ok = isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)
        if not ok:
            raise DataError(f"row {row_id}: chat {key!r} must be a text or a non-empty list of "
                            f"{{'role': ..., 'content': <text>}} messages, got {_short(repr(raw))!r}; fix the data")
        truth = row.get("ground_truth")
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages],
                "ground_truth": "" if truth is None else str(truth), "data_source": _source(row, self.name),
                **_extra(row, row_id)}


def is_verl_row(row: Any) -> bool:
    """A row as verl's data preparation writes it: ``prompt`` a list of messages and ``reward_model`` a mapping."""
    return isinstance(row, dict) and isinstance(row.get("prompt"), list) and isinstance(row.get("reward_model"), dict)


def verl_row(row: dict[str, Any], row_id: int, task: str) -> dict[str, Any]:
    """A verl row as it is: its messages, ``reward_model.ground_truth`` (text; a list or mapping as JSON), its
    ``data_source`` (else the task's name) and ``extra_info``."""
    messages = row["prompt"]
    if not messages or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                               and isinstance(m.get("content"), str) for m in messages):
        raise DataError(f"row {row_id}: 'prompt' must be a non-empty list of {{'role': ..., 'content': <text>}} "
                        f"messages, got {_short(repr(messages))!r}; fix the data")
    truth = row["reward_model"].get("ground_truth")
    if truth is None:
        raise DataError(f"row {row_id}: 'reward_model' has no 'ground_truth' (its keys: "
                        f"{sorted(row['reward_model'])}); fix the data")
    text = truth if isinstance(truth, str) else json.dumps(truth, default=str)
    return {"messages": [{"role": m["role"], "content": m["content"]} for m in messages], "ground_truth": text,
            "data_source": _source(row, task), **_extra(row, row_id)}


def _source(row: dict[str, Any], default: str) -> str:
    source = row.get("data_source")
    return source if isinstance(source, str) and source else default


def _extra(row: dict[str, Any], row_id: int) -> dict[str, Any]:
    """``{"extra_info": ...}`` for a row with an ``extra_info`` mapping (also what a multi-turn environment reads as
    its ``env_info``), else nothing."""
    extra = row.get("extra_info")
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise DataError(f"row {row_id}: 'extra_info' must be a mapping of fields, got {type(extra).__name__}; "
                        f"fix the data")
    return {"extra_info": extra, "env_info": extra}


TASKS: dict[str, Task] = {t.name: t for t in (Gsm8kTask(), SuccessorTask(), ArithTask(), LookupTask(), Mul3Task(),
                                              MathTask(), CodeTask(), ChatTask())}


def get_task(name: str) -> Task:
    """The registered task ``name``; DataError naming ``data.task`` otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise DataError(f"data.task={name!r} is not a known task; use one of {sorted(TASKS)}") from None


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
