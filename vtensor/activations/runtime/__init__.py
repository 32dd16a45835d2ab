"""One managed iteration: hooks that route, the guard, the books, admission of saved tensors."""
