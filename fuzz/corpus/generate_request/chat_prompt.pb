2

userhi