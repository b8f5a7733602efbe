"""Methods tandem adds to vLLM's worker processes (``worker_extension_cls``).

vLLM mixes this class into each worker; the engine calls its methods with
``collective_rpc("tandem_reload_weights", ...)``. This module is imported in
the worker process (spawned by vLLM), never in the API process.

Why it exists: vLLM's in-place ``reload_weights`` loads a checkpoint layer by
layer and re-runs each layer's post-load processing. A language-model head
*tied* to the input embeddings (``tie_word_embeddings``, e.g. the small Qwen3
models) receives no tensors of its own from the checkpoint, so its processing
is skipped ("ParallelLMHead: Failed to load weights" in the log). On GPU that
is harmless: the head reads the embedding tensor, which was updated. On the
CPU backend the head computes with a prepacked copy of the weight
(``dispatch_cpu_unquantized_gemm``: oneDNN / SGL packed GEMM), which then
keeps the *old* weights: logits come from the old head and the new body.
tandem's logprob test against Hugging Face caught it. The fix here re-runs
the head's post-load processing after a reload, which repacks it from the
(already updated) shared tensor; on GPU that processing is a no-op.
"""

from __future__ import annotations


class TandemWorkerExtension:
    def tandem_reload_weights(self, weights_path: str) -> bool:
        """Reload weights in place from ``weights_path``; return whether a tied head was refreshed."""
        self.model_runner.reload_weights(weights_path=weights_path, is_checkpoint_format=True)
        return self._tandem_refresh_tied_head()

    def tandem_receive_weights(self, host: str, port: int, rank: int, world: int, group: str,
                               timeout_s: float, key: str) -> str | None:
        """Join the learner's weight group for one version as ``rank`` (plus this worker's own rank among
        the server's workers), receive the tensors, check the learner's digest and load them in place with
        the same post-load processing as a file reload. Returns None once loaded, else why nothing was
        loaded (the group failed or the digest differs: the weights are untouched; ``services.weightgroup``).
        A failure inside the load itself raises, as a file reload's does. ``key``: the run's broadcast key, hex."""
        from services.weightgroup import BroadcastFailed, WeightGroup

        try:
            member = WeightGroup(host, port, rank + getattr(self, "rank", 0), world, key=bytes.fromhex(key),
                                 timeout_s=timeout_s, name=group)
            tensors, _ = member.receive()
        except BroadcastFailed as e:
            return str(e)
        self.model_runner.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        self._tandem_refresh_tied_head()
        return None

    def _tandem_refresh_tied_head(self) -> bool:
        model = self.model_runner.get_model()
        config = self.model_runner.model_config.hf_config
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        if not getattr(text_config, "tie_word_embeddings", False):
            return False
        head = getattr(model, "lm_head", None)
        method = getattr(head, "quant_method", None)
        if method is None or not hasattr(method, "process_weights_after_loading"):
            return False
        method.process_weights_after_loading(head)
        return True
