"""One decision per input signature: profile, calibrate, solve, validate (NOTE [one decision])."""
