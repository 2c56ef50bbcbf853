"""SFT with `transformers.Trainer`, agrpo-packing as the data collator and agrpo-attention's tree attention.

Multi-turn chats that all open with one long system prompt are tokenized with the chat template, the
assistant tokens labelled (-100 elsewhere, the transformers/TRL convention). `SFTCollator` puts each
batch into one prefix-tree row, so the system prompt is forwarded once per batch instead of once per
conversation, and tree attention lets every token see exactly its own conversation: the loss is the
loss of the stock padded batches, which this script checks by running both side by side from the same
initial weights and data order.

    python examples/sft_packed_chat.py [--kind qwen3|hybrid] [--steps 6] [--batch-size 8]

Runs on CPU in well under a minute (a tiny random model from `agrpo_attention.testing`); for a real model,
load it with `AutoModelForCausalLM.from_pretrained` and keep the rest.
"""

from __future__ import annotations

import argparse
import copy
import random
import tempfile
from dataclasses import dataclass

from transformers import DataCollatorForSeq2Seq, PrinterCallback, Trainer, TrainingArguments

from agrpo_attention import enable_tree_attention, token_logprobs
from agrpo_attention.testing import TinyModelSpec, build_model, build_tokenizer
from agrpo_packing import SFTCollator

SYSTEM_PROMPT = (
    "You are a patient arithmetic tutor. Answer every question with the result first, then one short "
    "sentence that names the rule you used. Never skip a step, never guess, and say so when a question "
    "is not arithmetic. Keep answers under twenty words and use digits, not words, for numbers."
)


def make_conversations(num_conversations: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """Chats of two or three exchanges, each opening with SYSTEM_PROMPT."""
    rng = random.Random(seed)
    chats = []
    for _ in range(num_conversations):
        messages = [{"role": "system", "content": SYSTEM_PROMPT}]
        for _ in range(rng.randint(2, 3)):
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            messages.append({"role": "user", "content": f"What is {a} + {b}?"})
            messages.append({"role": "assistant", "content": f"{a + b}, by adding the tens, then the units."})
        chats.append(messages)
    return chats


def tokenize(messages: list[dict[str, str]], tokenizer) -> dict[str, list[int]]:
    """input_ids of the chat; labels = input_ids on each assistant message's tokens, -100 elsewhere.

    An assistant message spans from the end of the prefix rendered with the generation prompt to the end of
    the prefix that includes it (this needs a template that renders prefixes as prefixes, as ChatML does)."""
    ids = tokenizer.apply_chat_template(messages)["input_ids"]
    labels = [-100] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] == "assistant":
            start = len(tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)["input_ids"])
            end = len(tokenizer.apply_chat_template(messages[: i + 1])["input_ids"])
            labels[start:end] = ids[start:end]
    return {"input_ids": ids, "labels": labels}


class PackedSFTTrainer(Trainer):
    """The Trainer, with the loss computed from one packed tree row per batch."""

    loss_is_scaled_for_ga = False  # a per-batch token mean: the Trainer divides it by gradient accumulation

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        row = inputs["packed_row"].to(self.args.device)
        return -token_logprobs(model, row).mean()  # mean NLL over the batch's assistant tokens


@dataclass(frozen=True, slots=True)
class RunResult:
    losses: list[float]
    """Training loss of each optimizer step."""
    forwarded_tokens: int
    """Tokens the model forwarded over the run (padding included for padded batches)."""


def _arguments(output_dir: str, steps: int, batch_size: int) -> TrainingArguments:
    return TrainingArguments(
        output_dir=output_dir, max_steps=steps, per_device_train_batch_size=batch_size, learning_rate=3e-3,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0,
        include_num_input_tokens_seen="all", disable_tqdm=True,
    )  # fmt: skip


def train(model, tokenizer, dataset, *, packed: bool, steps: int, batch_size: int) -> RunResult:
    """`steps` optimizer steps of SFT on `dataset`, packed into tree rows or as stock padded batches."""
    with tempfile.TemporaryDirectory() as output_dir:
        args = _arguments(output_dir, steps, batch_size)
        if packed:
            enable_tree_attention(model)
            trainer = PackedSFTTrainer(model=model, args=args, train_dataset=dataset, data_collator=SFTCollator())
        else:
            padding = DataCollatorForSeq2Seq(tokenizer, padding=True)  # pads labels with -100
            trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=padding)
        trainer.remove_callback(PrinterCallback)  # main() prints the losses side by side instead
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return RunResult(losses=losses, forwarded_tokens=trainer.state.num_input_tokens_seen)


def main(argv: list[str] | None = None) -> tuple[RunResult, RunResult, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", default="qwen3", choices=["qwen3", "hybrid"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    tokenizer = build_tokenizer()
    model = build_model(TinyModelSpec(kind=args.kind, num_layers=4 if args.kind == "hybrid" else 2), tokenizer)
    model.train()
    chats = make_conversations(args.steps * args.batch_size)
    dataset = [tokenize(chat, tokenizer) for chat in chats]
    raw_tokens = sum(len(example["input_ids"]) for example in dataset)
    padded = train(copy.deepcopy(model), tokenizer, dataset, packed=False, steps=args.steps, batch_size=args.batch_size)
    packed = train(model, tokenizer, dataset, packed=True, steps=args.steps, batch_size=args.batch_size)
    print("step  packed loss  padded loss")
    for step, (a, b) in enumerate(zip(packed.losses, padded.losses, strict=True), 1):
        print(f"{step:>4}  {a:11.6f}  {b:11.6f}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(packed.losses, padded.losses, strict=True))
    print(f"max relative loss difference over {args.steps} steps: {worst:.1e}")
    print(
        f"forwarded tokens: {packed.forwarded_tokens} packed, {raw_tokens} in the examples, "
        f"{padded.forwarded_tokens} in padded batches: {raw_tokens / packed.forwarded_tokens:.2f}x fewer than "
        f"the examples' tokens, {padded.forwarded_tokens / packed.forwarded_tokens:.2f}x fewer than padding"
    )
    return packed, padded, raw_tokens


if __name__ == "__main__":
    main()
