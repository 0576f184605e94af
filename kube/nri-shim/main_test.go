package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/containerd/nri/pkg/api"
)

// fakeAgent serves handler on a unix socket and returns a plugin that talks to it.
func fakeAgent(t *testing.T, handler http.HandlerFunc) *plugin {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return &plugin{
		token:   "tok",
		timeout: time.Second,
		client: &http.Client{Transport: &http.Transport{
			DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
				var d net.Dialer
				return d.DialContext(ctx, "unix", sock)
			},
		}},
	}
}

func guaranteedContainer() (*api.PodSandbox, *api.Container) {
	pod := &api.PodSandbox{
		Id: "pod1", Uid: "uid-1", Namespace: "default", Name: "web",
		Annotations: map[string]string{"nodeagent.io/numa": "single", "other.io/x": "y"},
		Linux:       &api.LinuxPodSandbox{CgroupParent: "/kubepods/poduid-1"},
	}
	ctr := &api.Container{
		Id: "c1", PodSandboxId: "pod1", Name: "app", State: api.ContainerState_CONTAINER_CREATED,
		Linux: &api.LinuxContainer{Resources: &api.LinuxResources{
			Cpu:    &api.LinuxCPU{Shares: api.UInt64(uint64(1024)), Quota: api.Int64(int64(100000)), Period: api.UInt64(uint64(100000))},
			Memory: &api.LinuxMemory{Limit: api.Int64(int64(64 << 20))},
		}, Devices: []*api.LinuxDevice{{Path: "/dev/accel0", Type: "b", Major: 7, Minor: 3}}},
	}
	return pod, ctr
}

func TestCreateForwardsTheContainerAndAppliesTheAnswer(t *testing.T) {
	var got container
	p := fakeAgent(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Path != "/v1/nri/containers" || r.Header.Get("Authorization") != "Bearer tok" {
			http.Error(w, "unexpected "+r.Method+" "+r.URL.Path, http.StatusTeapot)
			return
		}
		body, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(body, &got)
		_, _ = w.Write([]byte(`{"container_id":"c1","slot_id":"s1","slot_name":"nri-c1","qos":"guaranteed","cpuset_cpus":"3","cpuset_mems":"0","memory_limit":67108864}`))
	})
	pod, ctr := guaranteedContainer()
	adj, updates, err := p.CreateContainer(context.Background(), pod, ctr)
	if err != nil || updates != nil {
		t.Fatalf("CreateContainer: %v %v", err, updates)
	}
	if got.ID != "c1" || got.Pod.CgroupParent != "/kubepods/poduid-1" || got.Resources.CPUQuota != 100000 ||
		got.Resources.MemoryLimit != 64<<20 || got.Pod.Annotations["nodeagent.io/numa"] != "single" {
		t.Fatalf("sent %+v", got)
	}
	if _, ok := got.Pod.Annotations["other.io/x"]; ok {
		t.Fatalf("forwarded an annotation that is not the agent's: %+v", got.Pod.Annotations)
	}
	if len(got.Devices) != 1 || got.Devices[0] != (linuxDevice{Path: "/dev/accel0", Type: "b", Major: 7, Minor: 3}) {
		t.Fatalf("devices sent %+v", got.Devices)
	}
	res := adj.GetLinux().GetResources()
	if res.GetCpu().GetCpus() != "3" || res.GetCpu().GetMems() != "0" || res.GetMemory().GetLimit().GetValue() != 64<<20 {
		t.Fatalf("adjustment %+v", res)
	}
}

func TestARefusalFailsTheCreationWithTheAgentsReason(t *testing.T) {
	p := fakeAgent(t, func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusConflict)
		_, _ = w.Write([]byte(`{"error":{"code":"does_not_fit","message":"need 3 exclusive CPUs"}}`))
	})
	pod, ctr := guaranteedContainer()
	_, _, err := p.CreateContainer(context.Background(), pod, ctr)
	if err == nil || !strings.Contains(err.Error(), "nodeagent refused (409 does_not_fit): need 3 exclusive CPUs") {
		t.Fatalf("error %v", err)
	}
}

func TestAnAgentThatDoesNotAnswerFailsTheCreationInTime(t *testing.T) {
	p := fakeAgent(t, func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	p.timeout = 100 * time.Millisecond
	pod, ctr := guaranteedContainer()
	_, _, err := p.CreateContainer(context.Background(), pod, ctr)
	if err == nil || !strings.Contains(err.Error(), "nodeagent did not answer") {
		t.Fatalf("error %v", err)
	}
}

func TestSynchronizeLeavesStoppedContainersOutAndTurnsUpdates(t *testing.T) {
	var sent struct {
		Containers []container `json:"containers"`
	}
	p := fakeAgent(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		_ = json.Unmarshal(body, &sent)
		_, _ = w.Write([]byte(`{"updates":[{"container_id":"c1","slot_id":"s1","slot_name":"nri-c1","qos":"guaranteed","cpuset_cpus":"3","cpuset_mems":"0","memory_limit":0},{"container_id":"c3","slot_id":"s3","slot_name":"nri-c3","qos":"best-effort"}],"released":[],"refused":{}}`))
	})
	pod, ctr := guaranteedContainer()
	stopped := &api.Container{Id: "c2", PodSandboxId: "pod1", State: api.ContainerState_CONTAINER_STOPPED}
	updates, err := p.Synchronize(context.Background(), []*api.PodSandbox{pod}, []*api.Container{ctr, stopped})
	if err != nil {
		t.Fatal(err)
	}
	if len(sent.Containers) != 1 || sent.Containers[0].ID != "c1" || sent.Containers[0].Pod.Name != "web" {
		t.Fatalf("sent %+v", sent.Containers)
	}
	if len(updates) != 1 || updates[0].GetContainerId() != "c1" || updates[0].GetLinux().GetResources().GetCpu().GetCpus() != "3" {
		t.Fatalf("updates %+v", updates)
	}
}

func TestFailOpenCreatesUnplacedOnlyWhileTheAgentDoesNotAnswer(t *testing.T) {
	p := fakeAgent(t, func(_ http.ResponseWriter, r *http.Request) { <-r.Context().Done() })
	p.timeout = 100 * time.Millisecond
	p.failOpen = true
	pod, ctr := guaranteedContainer()
	adj, _, err := p.CreateContainer(context.Background(), pod, ctr)
	if err != nil || adj != nil {
		t.Fatalf("fail-open: %v %v", adj, err)
	}
	if !p.lost.Load() {
		t.Fatal("the agent is not marked lost: no Synchronize would place the container later")
	}
	refusing := fakeAgent(t, func(w http.ResponseWriter, _ *http.Request) {
		w.WriteHeader(http.StatusUnprocessableEntity)
		_, _ = w.Write([]byte(`{"error":{"code":"invalid_request","message":"unknown annotation"}}`))
	})
	refusing.failOpen = true
	if _, _, err := refusing.CreateContainer(context.Background(), pod, ctr); err == nil {
		t.Fatal("a refusal must fail the creation even with -fail-open")
	}
}

func TestAGuaranteedContainersAnswerMovesTheSharedOnes(t *testing.T) {
	p := fakeAgent(t, func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte(`{"container_id":"c1","slot_id":"s1","slot_name":"nri-c1","qos":"guaranteed","cpuset_cpus":"3","cpuset_mems":"0","memory_limit":67108864,` +
			`"updates":[{"container_id":"b1","cpuset_cpus":"0-2"},{"container_id":"b2","cpuset_cpus":"0-2","cpuset_mems":"0"}],"pool_version":"0-2"}`))
	})
	pod, ctr := guaranteedContainer()
	_, updates, err := p.CreateContainer(context.Background(), pod, ctr)
	if err != nil || len(updates) != 2 {
		t.Fatalf("CreateContainer: %v %v", err, updates)
	}
	for _, u := range updates {
		if u.GetLinux().GetResources().GetCpu().GetCpus() != "0-2" || !u.GetIgnoreFailure() {
			t.Fatalf("update %+v", u)
		}
	}
	if updates[1].GetContainerId() != "b2" || updates[1].GetLinux().GetResources().GetCpu().GetMems() != "0" {
		t.Fatalf("update %+v", updates[1])
	}
	if p.knownVersion() != "0-2" {
		t.Fatalf("version %q", p.knownVersion())
	}
}

type fakeRuntime struct {
	got  [][]*api.ContainerUpdate
	fail error
}

func (f *fakeRuntime) UpdateContainers(u []*api.ContainerUpdate) ([]*api.ContainerUpdate, error) {
	f.got = append(f.got, u)
	return nil, f.fail
}

func TestThePollAppliesPoolChangesAndRemembersTheVersion(t *testing.T) {
	var asked []string
	p := fakeAgent(t, func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodGet || r.URL.Path != "/v1/nri/updates" || r.Header.Get("Authorization") != "Bearer tok" {
			http.Error(w, "unexpected "+r.Method+" "+r.URL.Path, http.StatusTeapot)
			return
		}
		asked = append(asked, r.URL.Query().Get("version")+"/"+r.URL.Query().Get("wait"))
		if r.URL.Query().Get("version") == "0-3" {
			_, _ = w.Write([]byte(`{"version":"0-3","updates":[]}`))
			return
		}
		_, _ = w.Write([]byte(`{"version":"0-3","updates":[{"container_id":"b1","cpuset_cpus":"0-3"}]}`))
	})
	runtime := &fakeRuntime{}
	if !p.pollOnce(context.Background(), runtime) || !p.pollOnce(context.Background(), runtime) {
		t.Fatal("poll failed")
	}
	if strings.Join(asked, " ") != "/20 0-3/20" {
		t.Fatalf("asked %v", asked)
	}
	if len(runtime.got) != 1 || runtime.got[0][0].GetContainerId() != "b1" || runtime.got[0][0].GetLinux().GetResources().GetCpu().GetCpus() != "0-3" {
		t.Fatalf("applied %+v", runtime.got)
	}
	// The runtime refusing the updates keeps the old version, so the next poll brings them again.
	p.version.Store("")
	runtime.fail = errors.New("runtime busy")
	if p.pollOnce(context.Background(), runtime) || p.knownVersion() != "" {
		t.Fatalf("a failed update was remembered as applied: %q", p.knownVersion())
	}
}

func TestAPollItsRegistrationCancelsDoesNotMarkTheAgentLost(t *testing.T) {
	asked := make(chan struct{}, 1)
	p := fakeAgent(t, func(w http.ResponseWriter, r *http.Request) {
		asked <- struct{}{}
		<-r.Context().Done() // a long poll that has nothing to say yet
	})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan bool)
	go func() { done <- p.pollOnce(ctx, &fakeRuntime{}) }()
	<-asked
	cancel() // the registration ends (watch found the agent back, or the shim stops)
	if <-done {
		t.Fatal("a cancelled poll reported success")
	}
	if p.lost.Load() {
		t.Fatal("a poll its own registration cancelled marked the agent lost: the next registration would end at once")
	}
	// An agent that does not answer in time is lost.
	p.timeout = 10 * time.Millisecond
	go func() { <-asked }()
	if err := p.callWithin(context.Background(), 50*time.Millisecond, http.MethodGet, "/v1/nri/updates", nil, nil); err == nil {
		t.Fatal("no error from an agent that did not answer")
	}
	if !p.lost.Load() {
		t.Fatal("an agent that did not answer is not marked lost")
	}
}
