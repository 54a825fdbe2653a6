"""Capturing the raw outputs of chosen target decoder layers, stopping the forward after the last one;
and, when asked, the target's final hidden state too.

"Layer i" is the raw output of decoder layer i (0-based) = Hugging Face `output_hidden_states[i + 1]`.
Without the final state the forward never reaches later layers, the final norm or the LM head. With it
(`final_state=True`) the forward runs every layer and the final norm, whose output (what the LM head
reads; Hugging Face's `hidden_states[-1]`) is one more slot after the chosen layers: `[B, T, K + 1, H]`.
The LM head never runs either way, so no logits are ever computed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from dflash_assets.target.devices import current_device
from dflash_assets.target.layer_ids import resolve_target_layer_ids
from dflash_assets.target.model import find_decoder, hidden_size_of
from dflash_assets.target.tensor_parallel import full_tensor


class _StopForward(Exception):
    """Raised by the hook on the last needed layer so the forward goes no further."""


class HiddenStateCapture:
    """`capture(input_ids [B, T], attention_mask [B, T]) -> [B, T, K, H]` (`[B, T, K + 1, H]` with
    `final_state`, the last slot the target's final hidden state), in the model's dtype.

    Forward hooks copy each chosen layer's output into one preallocated buffer; the hook on the last
    chosen layer then raises, so later layers, the final norm and the LM head never run, unless the final
    state is wanted: the forward then runs to the final norm, whose output fills the last slot. Hooks are
    attached only for the duration of a call, so the model stays usable elsewhere.
    """

    def __init__(
        self, model: nn.Module, target_layer_ids: Sequence[int], *, final_state: bool = False
    ) -> None:
        self.model = model
        self.base_model, self.layers = find_decoder(model)
        self.target_layer_ids = resolve_target_layer_ids(
            {"num_hidden_layers": len(self.layers)}, list(target_layer_ids)
        )
        self.hidden_size = hidden_size_of(model.config)
        self.final_state = final_state

    @property
    def num_slots(self) -> int:
        """States a token gets: the chosen layers, and the final state when it is captured."""
        return len(self.target_layer_ids) + int(self.final_state)

    @property
    def device(self) -> torch.device:
        return next(self.base_model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        embeddings = self.base_model.get_input_embeddings()
        return embeddings.weight.dtype if embeddings is not None else next(self.base_model.parameters()).dtype

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"expected input_ids and attention_mask of the same shape [B, T], got "
                f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
            )
        device = self.device
        batch, length = input_ids.shape
        # Allocated outside inference mode (and filled in place inside it), so the result is an ordinary
        # tensor that online training can feed to modules that save inputs for backward.
        captured = torch.empty(
            (batch, length, self.num_slots, self.hidden_size), dtype=self.dtype, device=device
        )
        last = None if self.final_state else self.target_layer_ids[-1]
        seen: list[int] = []

        def make_hook(slot: int, layer_id: int):
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                hidden = output[0] if isinstance(output, tuple | list) else output
                captured[:, :, slot].copy_(full_tensor(hidden))  # a target split over devices: whole
                seen.append(layer_id)
                if layer_id == last:
                    raise _StopForward

            return hook

        handles = [
            self.layers[layer_id].register_forward_hook(make_hook(slot, layer_id))
            for slot, layer_id in enumerate(self.target_layer_ids)
        ]
        try:
            # This thread's current CUDA device is the model's (a replica's thread starts on GPU 0).
            with current_device(device), torch.inference_mode():
                output = self.base_model(
                    input_ids=_to_device(input_ids, device),
                    attention_mask=_to_device(attention_mask, device),
                    use_cache=False,
                )
                if self.final_state:  # after the final norm: what the LM head reads
                    captured[:, :, -1].copy_(full_tensor(final_hidden_state(output)))
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        if seen != self.target_layer_ids:
            raise RuntimeError(
                f"captured layers {seen}, expected {self.target_layer_ids}: the model's forward did not run "
                "its decoder layers in order"
            )
        return captured


def final_hidden_state(output: Any) -> torch.Tensor:
    """The base model's output after its final norm, `[B, T, H]` (`last_hidden_state`)."""
    hidden = getattr(output, "last_hidden_state", None)
    if hidden is None:
        hidden = output[0]
    return hidden


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A plain copy from pageable host memory makes the host wait for the device's queue to drain, which
    # would stall the overlap of this forward with the previous batch's copy back; pinned memory doesn't.
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class ReplicatedCapture:
    """The target on several devices feeding one trainer (online training: the seeds ran 7 target GPUs
    beside 1 drafter GPU). A batch's rows are split into one contiguous chunk per replica, the replicas
    run concurrently (each on its own device, so threads overlap), and the results are gathered on
    `output_device` in the original row order."""

    def __init__(self, captures: Sequence[HiddenStateCapture], output_device: str | torch.device) -> None:
        if not captures:
            raise ValueError("ReplicatedCapture needs at least one target replica")
        self.captures = list(captures)
        self.output_device = torch.device(output_device)
        self.target_layer_ids = self.captures[0].target_layer_ids
        self.hidden_size = self.captures[0].hidden_size
        self.final_state = self.captures[0].final_state

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from concurrent.futures import ThreadPoolExecutor

        chunks = [
            (capture, ids, mask)
            for capture, ids, mask in zip(
                self.captures,
                torch.tensor_split(input_ids, len(self.captures)),
                torch.tensor_split(attention_mask, len(self.captures)),
                strict=True,
            )
            if ids.shape[0] > 0
        ]
        if len(chunks) == 1:
            capture, ids, mask = chunks[0]
            return capture(ids, mask).to(self.output_device)
        with ThreadPoolExecutor(max_workers=len(chunks), thread_name_prefix="target-replica") as pool:
            futures = [pool.submit(capture, ids, mask) for capture, ids, mask in chunks]
            return torch.cat([future.result().to(self.output_device) for future in futures])
