"""The controller's part for the held-out loss (`train.eval_every`): which steps are evaluated (every `eval_every`-th
and the job's last), the evaluation between steps once a step is committed, and an evaluation a failure interrupted,
redone on that step's restored weights before the next step. A job that does not evaluate never enters this part.
Like the other parts it is inherited by control/controller.Controller; its attributes are
control/parts.ControllerParts'. Pure.
"""

from __future__ import annotations

from orchestrator.control.parts import ControllerParts
from orchestrator.control.states import Phase
from orchestrator.errors import WorkerFailure


class Evaluating(ControllerParts):
    def _eval_step(self, s: int) -> bool:
        """Step s is one the validation loss is evaluated after (every `eval_every`, and the job's last)."""
        every = self.train.eval_every
        return bool(every) and s >= 0 and ((s + 1) % every == 0 or s + 1 == self.steps)

    def _evaluate_after(self, s: int) -> None:
        """Between steps, after step s's commit: its validation loss, where s is one to evaluate after."""
        if self._eval_step(s):
            self.progress.val_losses[s] = self.workers.evaluate(self.train.eval_batches)

    def _redo_interrupted(self, s: int) -> Phase | None:
        """Before step s: step s - 1's evaluation, where a failure interrupted it, on that step's restored weights.
        None where there was none to redo (or it is done); the next state where it failed in turn."""
        if not self._eval_step(s - 1) or s - 1 in self.progress.val_losses:
            return None
        try:
            val = self.progress.val_losses[s - 1] = self.workers.evaluate(self.train.eval_batches)
        except WorkerFailure as e:
            return self._decide(e)
        self._event("evaluation", f"validation loss after step {s - 1}: {val:.4f}, evaluated on its restored "
                    "weights (a failure interrupted the first evaluation)", step=s - 1, val_loss=val)
        return None
