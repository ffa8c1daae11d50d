"""Number formats and mixed precision: bits, ranges, rounding, loss scaling."""
