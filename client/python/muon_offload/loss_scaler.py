"""Dynamic loss scaling for fp16 training with the optimizer in muond (apply mode).

DynamicLossScaler follows DeepSpeed's DynamicLossScaler: the loss is multiplied by `scale` before
backward, so fp16 gradients keep their small values; the optimizer divides the gradients by the
same scale (MuonWithAuxAdam passes it to muond as the step's gradient divisor). A step whose
gradients overflowed (a NaN or Inf on any rank) is skipped by muond (job option
"nonfinite": "skip"): nothing changes, and the scaler is told so.

  - After `scale_window` consecutive good steps since the last overflow, the scale is multiplied
    by `scale_factor`.
  - On an overflow the scale is divided by `scale_factor` (never below `min_scale`) once
    `hysteresis` overflows have been seen since the last good window: with hysteresis h, the
    first h - 1 overflows only use up the allowance. With `consecutive_hysteresis`, any good
    step restores the allowance; without it (the default), only a window of good steps that
    raises the scale does.
  - `raise_error_at_min_scale`: an overflow at the minimum scale raises instead of skipping
    forever.

Usage with MuonWithAuxAdam(..., mode="apply", loss_scaler=scaler):
    loss = model(x)
    scaler.backward(loss)        # or (loss * scaler.scale).backward()
    opt.step()                   # divides by the scale in muond; updates the scaler
    opt.last_step_skipped        # True when muond skipped the step

Thread-safety: none; one optimizer owns it. state_dict()/load_state_dict() for checkpoints.
"""
import math


class DynamicLossScaler:
    def __init__(self, init_scale=2.0 ** 16, scale_factor=2.0, scale_window=1000, min_scale=1.0,
                 hysteresis=2, consecutive_hysteresis=False, raise_error_at_min_scale=False):
        for name, value in (("init_scale", init_scale), ("min_scale", min_scale)):
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a finite number > 0, not {value!r}")
        if not (isinstance(scale_factor, (int, float)) and math.isfinite(scale_factor)
                and scale_factor > 1):
            raise ValueError(f"scale_factor must be a finite number > 1, not {scale_factor!r}")
        for name, value in (("scale_window", scale_window), ("hysteresis", hysteresis)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, not {value!r}")
        if init_scale < min_scale:
            raise ValueError(f"init_scale {init_scale} is below min_scale {min_scale}")
        self.scale = float(init_scale)
        self.scale_factor = float(scale_factor)
        self.scale_window = int(scale_window)
        self.min_scale = float(min_scale)
        self.hysteresis = int(hysteresis)
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.raise_error_at_min_scale = bool(raise_error_at_min_scale)
        self.cur_hysteresis = self.hysteresis
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.overflows = 0

    @property
    def loss_scale(self):
        """The current scale (DeepSpeed's name)."""
        return self.scale

    def scale_loss(self, loss):
        """`loss` times the scale (backward of it gives scaled gradients)."""
        return loss * self.scale

    def backward(self, loss, **kwargs):
        """Backward of the scaled loss."""
        self.scale_loss(loss).backward(**kwargs)

    def update(self, overflow):
        """Called once per optimizer step with whether its gradients overflowed (it was skipped)."""
        if overflow:
            self.overflows += 1
            if self.hysteresis == 1 or self.cur_hysteresis == 1:
                if self.scale <= self.min_scale and self.raise_error_at_min_scale:
                    raise FloatingPointError(
                        f"the gradients overflowed at the minimum loss scale {self.min_scale}")
                self.scale = max(self.scale / self.scale_factor, self.min_scale)
            else:
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.hysteresis
            if (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.hysteresis
                self.scale *= self.scale_factor
        self.cur_iter += 1

    _STATE = ("scale", "cur_hysteresis", "cur_iter", "last_overflow_iter", "overflows")

    def state_dict(self):
        return {k: getattr(self, k) for k in self._STATE}

    def load_state_dict(self, state):
        missing = [k for k in self._STATE if k not in state]
        if missing:
            raise KeyError(f"DynamicLossScaler state lacks {missing}")
        for k in self._STATE:
            setattr(self, k, type(getattr(self, k))(state[k]))
