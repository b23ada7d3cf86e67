"""Which served model takes a request: the task picks it, a `model` field, if given, must name one that serves it.

An app serves one model per MiniMax-H3 partition it lists (`minimax-h3`: t2va and fl2va on the FL2VA transformer;
`minimax-h3-ref2va`: ref2va on the Ref2VA one). Both APIs ask `choose_model` (the video jobs through
`jobs.service.JobService.resolve`, `/v1/generations` in the ingress), so a request reaches the same model either
way. Refusals are `InvalidVideoRequest`s (422) naming the field: `model` for a name nothing here serves, or for a
named model that does not serve the request's task; the task's own field (`task_field`) when no model serves it.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.limits import ModelLimits
from jobs.errors import InvalidVideoRequest

__all__ = ["choose_model", "served_tasks"]


def served_tasks(models: Sequence[ModelLimits]) -> tuple[str, ...]:
    """Every task some model of `models` serves, in the order they list them."""
    return tuple(dict.fromkeys(task for model in models for task in model.tasks))


def choose_model(models: Sequence[ModelLimits], task: str, requested: str | None,
                 task_field: str = "prompt") -> ModelLimits:
    """The model of `models` that serves `task`: `requested` when given (it must be served here and serve
    `task`), else the first listed that serves it. `task_field`: the request field that made it this task (the
    first keyframe's or reference's, `prompt` for text alone). With one served model and no `requested`, that
    model: its own checks (`jobs.limits.resolve_spec`, the engine) name what it serves."""
    if not models:
        raise ValueError("choose_model: no served models")
    if requested is not None:
        model = next((m for m in models if m.name == requested), None)
        if model is None:
            raise InvalidVideoRequest("model", f"{requested!r} is not served here; served: "
                                               f"{sorted(m.name for m in models)}")
        if task not in model.tasks and len(models) > 1:
            others = [m.name for m in models if task in m.tasks]
            hint = f"; {task} is served by {', '.join(others)}" if others else ""
            raise InvalidVideoRequest("model", f"{requested} serves {', '.join(model.tasks)}, not {task}{hint}")
        return model
    model = next((m for m in models if task in m.tasks), None)
    if model is not None or len(models) == 1:
        return model or models[0]
    served = "; ".join(f"{m.name} serves {', '.join(m.tasks)}" for m in models)
    raise InvalidVideoRequest(task_field, f"{task} is not served here: the served tasks are "
                                          f"{', '.join(served_tasks(models))} ({served})")
