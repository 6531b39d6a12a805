"""toolcalc: a toy tool-using world with checkable answers, a tokenizer and chat template, and a
prepare step that trains a teacher worth distilling and a clearly worse student."""
