//go:build linux

package main

import "syscall"

// childAttr puts a child in its own process group, so that Ctrl-C reaches devstack alone and
// devstack stops the children in order, and asks the kernel to send it SIGTERM should devstack
// die without stopping it (kill -9, a crash, a test that killed it): no process is left
// running. (The signal follows the thread that started the child; Go ends a thread only when
// a goroutine locked to it returns, which devstack has none of.)
func childAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
}
