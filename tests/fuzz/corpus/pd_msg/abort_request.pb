
cmpl-9