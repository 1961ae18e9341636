"""Data readers at the bottom of the stack: task rows (HellaSwag), corpus files and text packing."""
