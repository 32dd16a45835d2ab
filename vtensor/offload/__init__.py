"""ParamOffload: parameters, gradients and optimizer state in the storage tier between uses."""
