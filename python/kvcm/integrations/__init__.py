"""Engine integrations of kvcm (each an optional extra; the core never imports them)."""
