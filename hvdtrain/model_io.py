"""A trained model outside the training loop: ``eval`` (under Horovod, like training), ``export`` (no Horovod) to a
framework's own formats or ONNX, and the recipe's model built offline with given weights.

Functions of a :class:`~hvdtrain.trainer.Trainer` (its recipe contract: builders, datasets, ``input_shape``,
``preprocessing``); ``Trainer.run_eval`` and ``Trainer.export`` are the entry points the CLI calls.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Tuple

import numpy as np

from . import weights
from .config import ConfigError


def run_eval(trainer) -> Dict[str, Any]:
    """Evaluate --init-from's weights on the validation set under Horovod (each sample once over all ranks), with
    fit()'s failure handling; rank 0 prints the figures and writes OUTPUT_DIR/eval.json."""
    def work():
        trainer.setup(restore=False)
        b, cfg = trainer.backend, trainer.cfg
        metrics, count = trainer.evaluation()
        out = {**metrics, "count": count, "world_size": b.size, "framework": b.name, "source": cfg.init_from,
               "precision": cfg.precision}
        if b.rank == 0:
            with open(os.path.join(cfg.output_dir, "eval.json"), "w") as f:
                json.dump(out, f, indent=2)
            from .callbacks import format_figures
            print(f"hvdtrain: eval: {format_figures(metrics)} over {out['count']} samples on {out['world_size']} worker(s); "
                  f"{trainer.output_location}/eval.json", flush=True)
        return out
    return trainer.guarded(work)


def sample_inputs(trainer, framework: str, n: int = 8) -> Tuple[np.ndarray, str]:
    """Up to ``n`` validation inputs (float32, the model's preprocessing applied) and where they came from; a
    seeded normal batch where the recipe's data is not at hand."""
    try:
        _, val = trainer.datasets_for(framework, world_size=1)
        if val is not None and len(val):
            xs = [np.asarray(val[i][0], np.float32) for i in range(min(n, len(val)))]
            return np.stack(xs), f"{len(xs)} validation samples"
    except (ConfigError, OSError) as e:
        why = str(e)
    else:
        why = "no validation set"
    shape = trainer.input_shape or ()
    return (np.random.default_rng(0).standard_normal((n,) + tuple(shape)).astype(np.float32),
            f"{n} random inputs ({why})")


def offline_model(trainer, backend, arrays: Dict[str, np.ndarray], source: str):
    """The recipe's model on ``backend`` (not initialised: no Horovod), holding ``arrays``."""
    model = backend.prepare_model(trainer.framework_hook("build", backend.name)(), trainer.input_shape)
    fitted, kept = weights.fit(backend.model_arrays(model), arrays, source, to=backend.weight_naming)
    if kept:
        raise weights.WeightsError(f"{source} has another class count than the model ({', '.join(kept)}); "
                                   f"pass --num-classes")
    backend.assign_model_arrays(fitted, model)
    return model


def export(trainer, source: str, fmt: str, directory: str) -> Dict[str, Any]:
    """Write the weights in ``source`` as the recipe's model on --framework, in that framework's own formats
    (``native``) or as ONNX (through a framework that exports it), plus model.json (recipe, classes, input,
    preprocessing) and sample.npz (inputs and the logits of the source model, in the framework that wrote it).
    No Horovod. Returns model.json's content, with the largest difference between the source's logits and the
    exported model's (``max_abs_diff``)."""
    from .backends import BACKENDS, backend_class
    cfg = trainer.cfg
    if not trainer.input_shape:
        raise ConfigError(f"recipe {trainer.name} declares no input_shape (one floating-point input of a fixed "
                          f"shape): export writes such models only; its checkpoints hold the weights by name")
    arrays, info = weights.read(source)
    target = backend_class(cfg.framework)()
    if fmt == "onnx" and not target.exports_onnx:
        able = [n for n in BACKENDS if getattr(trainer, f"build_{n}", None) and _exports_onnx(n)]
        if not able:
            raise ConfigError(f"recipe {trainer.name} has no model on a framework that exports ONNX")
        target = backend_class(able[0])()
    model = offline_model(trainer, target, arrays, source)
    x, what = sample_inputs(trainer, target.name)
    logits = target.predict(model, x)
    reference, ref_framework = logits, target.name
    if info.get("framework") in BACKENDS and info["framework"] != target.name:
        ref_backend = backend_class(info["framework"])()
        reference = ref_backend.predict(offline_model(trainer, ref_backend, arrays, source), x)
        ref_framework = ref_backend.name
    os.makedirs(directory, exist_ok=True)
    if fmt == "onnx":
        target.export_onnx(model, os.path.join(directory, "model.onnx"), trainer.input_shape)
        files = {"onnx": "model.onnx"}
        logits = onnxruntime_logits(os.path.join(directory, "model.onnx"), x)
    else:
        files = target.export_native(model, directory, trainer.input_shape)
    np.savez(os.path.join(directory, "sample.npz"), inputs=x, logits=reference)
    head = [np.shape(arrays[n])[0] for n in weights.classifier(arrays) if len(np.shape(arrays[n])) == 2]
    meta = {"format": "hvdtrain-export", "kind": fmt, "framework": target.name if fmt == "native" else "onnx",
            "recipe": trainer.name, "model": getattr(cfg, "model", None),
            "num_classes": head[0] if head else None, "input_shape": list(trainer.input_shape),
            "input": "float32 N x " + " x ".join(map(str, trainer.input_shape)) + ", preprocessed as below",
            "output": trainer.output_description, "preprocessing": trainer.preprocessing(),
            **files, "source": info.get("path", source), "source_framework": info.get("framework"),
            "epoch": info.get("epoch"), "global_step": info.get("global_step"), "metrics": source_metrics(info), "config": json.loads(cfg.to_json()),
            "sample": {"file": "sample.npz", "inputs": what, "logits_from": ref_framework},
            "max_abs_diff": float(np.abs(logits - reference).max()),
            "logit_scale": float(np.abs(reference).max())}
    with open(os.path.join(directory, "model.json"), "w") as f:
        json.dump(meta, f, indent=2)
    return meta


def source_metrics(info: Dict[str, Any]) -> Dict[str, Any]:
    """The validation figures the run recorded for the weights of a checkpoint it wrote ({} when unknown): the
    task's own metrics travel with the exported model. The record is the one of the checkpoint's global step: a
    checkpoint inside an epoch (--checkpoint-every-steps, a --max-steps stop) has the figures of its own record where
    one was written at that step (the stop's), and none otherwise, never the previous epoch's."""
    path, epoch, step = info.get("path"), info.get("epoch"), info.get("global_step")
    if not path or (epoch is None and step is None):
        return {}
    records = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(path))), "metrics.jsonl")
    try:
        with open(records) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    except (OSError, ValueError):
        return {}
    if step is not None:
        row = next((r for r in reversed(rows) if r.get("global_step") == step), {})
    else:  # a checkpoint of a version that did not say its step: whole epochs only
        row = next((r for r in reversed(rows) if r.get("epoch") == epoch), {}) if not info.get("offset") else {}
    return {k: v for k, v in row.items() if k.startswith("val_")}


def _exports_onnx(framework: str) -> bool:
    from .backends import backend_class
    try:
        return backend_class(framework).exports_onnx
    except ImportError:  # that framework is not installed
        return False


def onnxruntime_logits(path: str, x: np.ndarray) -> np.ndarray:
    """``x`` through the ONNX file at ``path`` with onnxruntime (the onnx extra)."""
    try:
        import onnxruntime
    except ImportError:
        raise ConfigError("--format onnx needs the onnx extra: pip install 'hvdtrain[onnx]' "
                          "(onnx, onnxscript, onnxruntime)") from None
    session = onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]
