"""The model runner (V2 design): persistent request table, step inputs gathered on the device."""
