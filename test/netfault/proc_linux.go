package netfault

import "syscall"

// childAttr makes a child die with the test process (a killed test leaves no process behind).
func childAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL} }

// processAlive reports whether a process with pid exists.
func processAlive(pid int) bool { return syscall.Kill(pid, 0) == nil }
