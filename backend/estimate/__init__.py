"""Back-of-envelope estimates of training time and memory."""
