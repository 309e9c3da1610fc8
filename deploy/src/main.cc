// moeserve: serves Mixture-of-Experts models larger than the GPUs at hand.
#include "commands.h"

int main(int argc, char** argv) { return moe::deploy::RunMoeserve(argc, argv); }
